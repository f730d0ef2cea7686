"""A store holding NaN features (which `dflash inspect verify` flags) trained for the whole run
with loss nan, then died at its first checkpoint with 'data-parallel replicas diverged: [nan,
nan]' on a single process, never naming the cause (helper-98's nvfp4 walkthrough). Training now
stops at the first non-finite step, names it, its sequences and the check that finds the bad
values, and saves nothing after it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.store_files import record_shard_files
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "nvfp4"])
def test_nan_features_stop_training_at_once_naming_the_check(
    tmp_path: Path, hidden_dtype: str
) -> None:
    store = build_store(
        tmp_path / "store", FactorySpec(num_sequences=12, hidden_dtype=hidden_dtype)
    )
    for folder in sorted((store / "shards").iterdir()):  # every sequence: the first step meets one
        group = zarr.open_group(folder, mode="r+")
        if hidden_dtype == "bfloat16":
            hidden = group["hidden"][...]
            hidden[:, :, 0, 0] = 0x7FC0  # a bf16 NaN
            group["hidden"][...] = hidden
        else:
            scale = group["hidden_scale"][...]
            scale[:, :, 0] = np.nan
            group["hidden_scale"][...] = scale
        record_shard_files(folder)  # the sizes a v2 store records, as extract does
    out = tmp_path / "run"
    sets = [
        f"data.store={store}",
        f"run.out={out}",
        "run.progress=false",
        "optim.max_steps=6",
        "run.checkpoint_every=2",
    ]
    with pytest.raises(ValueError) as err:
        run_train(build_config(TrainConfig, DEBUG, "train", sets))
    message = " ".join(str(err.value).split())
    assert message.startswith("step 1: loss nan"), message
    assert f"dflash inspect verify {store}" in message and "optim.lr" in message
    assert "none saved" in message
    assert not list(out.glob("checkpoints/step-*"))  # the non-finite weights are not kept
