"""Review of the trainer's data path and resume: a negative data.seed, and the settings a resume
may change freely (data.prefetch_to_device, data.on_damaged)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, build_store

from common.store import open_store
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences, anchor_generator
from stage2_train.plan import EpochPlan
from stage2_train.resume import config_changes


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("review") / "s", FactorySpec(num_sequences=6))


def test_a_negative_data_seed_shuffles_and_samples_anchors(store: Path) -> None:
    """data.seed is any int: the epoch order takes a negative one, and so must the anchors
    (they stopped the run at its first batch with 'expected non-negative integer')."""
    assert sorted(EpochPlan(5, 1, 0, 1, 1, seed=-1).order(0).tolist()) == list(range(5))
    first = torch.randint(1 << 30, (4,), generator=anchor_generator(-1, 0, 3))
    again = torch.randint(1 << 30, (4,), generator=anchor_generator(-1, 0, 3))
    other = torch.randint(1 << 30, (4,), generator=anchor_generator(0, 0, 3))
    assert torch.equal(first, again) and not torch.equal(first, other)
    rows = StoreSequences(
        open_store(store),
        num_anchors=8,
        per_document=False,
        block_size=4,
        label_target="argmax",
        distill=False,
        seed=-1,
    )
    item = rows[(0, 0, False)]
    assert (item["anchors_A"] >= 0).sum() == 8


def test_prefetch_to_device_may_change_on_resume() -> None:
    """data.prefetch_to_device moves the same batches earlier (prefetch.py): a resume that turns
    it on or off is the same run, as with data.num_workers or data.prefetch."""
    saved = dataclasses.asdict(TrainConfig())
    current = dataclasses.asdict(TrainConfig())
    current["data"]["prefetch_to_device"] = True
    assert config_changes(saved, current) == ([], [])


def test_on_damaged_skip_may_be_set_on_resume() -> None:
    """A damaged chunk stops the run with 'or set data.on_damaged=skip to train without it';
    the rerun that does so resumes from the newest checkpoint (it was refused as another
    setting, asking for --allow-config-change): the run never trained past a damaged sequence."""
    saved = dataclasses.asdict(TrainConfig())
    current = dataclasses.asdict(TrainConfig())
    current["data"]["on_damaged"] = "skip"
    assert config_changes(saved, current) == ([], [])
