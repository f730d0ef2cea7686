"""`dflash train --follow` switched on (or off) when resuming a run whose epoch 0 is not finished
is refused first: before the check that asks for --allow-config-change, and before the lines
that say a config change was applied (they said data.follow was applied, then the stream check
refused it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from log_capture import dflash_messages
from store_factory import FactorySpec, build_store
from test_resume import train


@pytest.mark.parametrize("began,resumed", [("false", "true"), ("true", "false")])
def test_a_follow_switched_on_resume_is_refused_before_anything_is_applied(
    tmp_path: Path, began: str, resumed: str
) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=9))
    out = tmp_path / "run"
    train(store, out, "optim.max_steps=2", f"data.follow={began}")
    meta = json.loads((out / "step-000002" / "meta.json").read_text())
    assert meta["train_state"]["epoch"] == 0 and meta["train_state"]["step_in_epoch"] == 2
    flag = "with" if began == "true" else "without"
    refused = rf"epoch 0 was \w+ and is not finished: resume it {flag} --follow"
    for allow in ("false", "true"):  # not told to pass --allow-config-change first
        with dflash_messages(logging.INFO) as logged, pytest.raises(ValueError, match=refused):
            train(
                store,
                out,
                "optim.max_steps=4",
                f"data.follow={resumed}",
                f"run.allow_config_change={allow}",
            )
        assert not [line for line in logged if "config change applied" in line], logged
    # the same resume with the order it began in goes on, the change applied and logged
    with dflash_messages(logging.INFO) as logged:
        rows = train(
            store, out, "optim.max_steps=4", f"data.follow={began}", "run.allow_config_change=true"
        )
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert any("config change applied from step 2: optim.max_steps" in line for line in logged)
