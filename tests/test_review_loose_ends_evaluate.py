"""`dflash evaluate`'s JSON: `stop_at_eos` is a boolean and the ids the replies stop at have
their own field, `stop_ids` ([] when off). The field held the sorted ids when on and False
when off: a reader testing `figures["stop_at_eos"] is True` (or comparing it with the
setting) read every stopped run as off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluation.online import EvaluateConfig, run_evaluate


@pytest.mark.parametrize("stop", [True, False], ids=["stop_at_eos", "no_stop_at_eos"])
def test_stop_at_eos_is_a_boolean_and_the_ids_are_stop_ids(
    tiny_qwen3: Path, tmp_path: Path, stop: bool
) -> None:
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    cfg = EvaluateConfig(str(tiny_qwen3), str(data), num_prompts=1, new_tokens=4)
    cfg.stop_at_eos = stop
    figures = json.loads(json.dumps(run_evaluate(cfg)))  # as --json-out writes it
    assert figures["stop_at_eos"] is stop
    ids = figures["stop_ids"]
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert bool(ids) is stop and ids == sorted(ids)
