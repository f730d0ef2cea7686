"""run.gc_every: Python's automatic garbage collection is off inside the training loop and runs
on the loop's schedule (every gc_every steps, a full pass after evaluations), on and back on
however the loop ends."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, build_store

from common.config import build_config
from stage2_train.config import TrainConfig
from stage2_train.data import init_loader_worker
from stage2_train.gc_schedule import ScheduledGC
from stage2_train.train import run_train
from stage2_train.trainstep import StepRunner

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("gc") / "store", FactorySpec(num_sequences=9))


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false", "optim.max_steps=6"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_collections_follow_the_loop(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    enabled_in_steps = []
    collections = []  # generation argument of each gc.collect call
    queue = StepRunner.queue

    def spy_queue(self, *args, **kwargs):
        enabled_in_steps.append(gc.isenabled())
        return queue(self, *args, **kwargs)

    collect = gc.collect
    monkeypatch.setattr(StepRunner, "queue", spy_queue)
    monkeypatch.setattr(gc, "collect", lambda generation=2: collections.append(generation) or 0)
    assert gc.isenabled()
    rows = train(store, tmp_path / "run", "run.gc_every=2", "run.eval_every=3")
    monkeypatch.setattr(gc, "collect", collect)
    assert enabled_in_steps == [False] * 6
    assert gc.isenabled()  # back on after the loop
    assert [r["step"] for r in rows if "gc_s" in r] == [2, 4, 6]
    # the initial full pass, gen 1 at steps 2, 4, 6, a full pass after the evaluations (3, 6)
    assert collections == [2, 1, 2, 1, 1, 2]


def test_off_leaves_cpythons_schedule(store: Path, tmp_path: Path) -> None:
    rows = train(store, tmp_path / "run", "run.gc_every=0")
    assert gc.isenabled() and not any("gc_s" in r for r in rows)


def test_enabled_again_after_a_failure() -> None:
    with pytest.raises(RuntimeError), ScheduledGC(5):
        assert not gc.isenabled()
        raise RuntimeError("a step failed")
    assert gc.isenabled()


def test_negative_refused(store: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gc_every must be >= 0"):
        train(store, tmp_path / "run", "run.gc_every=-1")


class _WorkerGC(torch.utils.data.Dataset):
    """Answers, from the loader worker, whether its garbage collector is on."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        return gc.isenabled()


def test_loader_workers_forked_in_the_loop_collect_on_their_own() -> None:
    with ScheduledGC(5):
        loader = torch.utils.data.DataLoader(
            _WorkerGC(), num_workers=1, worker_init_fn=init_loader_worker
        )
        assert [bool(b) for b in loader] == [True, True]
