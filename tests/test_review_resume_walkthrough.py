"""Review (training interrupted and resumed, walked through as a careful user):

- A resume whose `drafter.*` names the values the run already had (an explicit
  `drafter.mask_token_id` or `hidden_size` equal to what the store resolves, unset again, or
  `drafter.init_norm_from_target`, which only sets the initial weights) was refused as a
  change "a resume cannot change"; a drafter that resolves otherwise under the same config (a
  mask token picked anew) went on silently. The resolved shape is compared now.
- A resume cut metrics.jsonl back to its checkpoint by rewriting it in place: a job killed
  then (a scheduler's SIGTERM or SIGKILL right after a requeue) lost the run's curves, every
  step before the checkpoint too. The cut is written beside the file and renamed over it.
- A second `dflash train --follow` into a run folder another training holds waited for the
  store first (until extract created it, or data.follow_timeout_s), and was refused only then;
  it is refused at once now.
- A run killed before its first checkpoint, rerun: metrics.jsonl starts again from step 1,
  but TensorBoard kept the killed run's steps beside the rerun's (purge_step was set only for
  a resume from a checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.locks import exclusive_lock
from stage2_train.config import TrainConfig
from stage2_train.metrics import MetricsWriter, read_records
from stage2_train.resume import check_same_run
from stage2_train.trackers import Trackers
from stage2_train.train import RUN_LOCK, run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
SETS = ["optim.max_steps=6", "run.checkpoint_every=2", "run.keep_checkpoints=5"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("walk") / "store", FactorySpec(num_sequences=9))


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false", *SETS]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def cut_after_step_4(out: Path) -> None:
    """What a run killed right after step 4's checkpoint leaves (metrics cut on resume)."""
    for name in ("step-000006", "export"):
        for path in sorted((out / name).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (out / name).rmdir()


def test_the_same_drafter_spelled_otherwise_resumes_exactly(store: Path, tmp_path: Path) -> None:
    full = train(store, tmp_path / "full")
    out = tmp_path / "run"
    train(store, out)
    # the store's mask token (3) and the target's width (64), named; the norm's initial value
    same = ["drafter.mask_token_id=3", "drafter.hidden_size=64", "drafter.head_dim=16"]
    for sets in (same, ["drafter.init_norm_from_target=false"], []):  # and unset again
        cut_after_step_4(out)
        resumed = train(store, out, *sets)
        assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    cut_after_step_4(out)
    with pytest.raises(ValueError, match=r"cannot change: drafter.mask_token_id: None -> 4;"):
        train(store, out, "drafter.mask_token_id=4")


def test_a_drafter_resolved_otherwise_under_the_same_config_is_refused(tmp_path: Path) -> None:
    config = {"drafter": {"mask_token_id": None, "num_layers": 2}}
    shape = {"num_layers": 2, "mask_token_id": 3, "hidden_size": 64, "num_tapped": 2}
    meta = {"config": config, "store_content_key": "k", "world_size": 1, "shape": shape}
    assert check_same_run(meta, config, 1, tmp_path, "k", shape=dict(shape)) == []
    picked_anew = {**shape, "mask_token_id": 5}
    with pytest.raises(ValueError, match=r"cannot change: the drafter's mask_token_id: 3 -> 5;"):
        check_same_run(meta, config, 1, tmp_path, "k", shape=picked_anew)
    # a config line already naming the field is not repeated
    wider = {"drafter": {"mask_token_id": None, "num_layers": 3}}
    with pytest.raises(ValueError, match=r"cannot change: drafter.num_layers: 2 -> 3; resume"):
        check_same_run(meta, wider, 1, tmp_path, "k", shape={**shape, "num_layers": 3})


class Killed(BaseException):
    """A SIGKILL, as far as the code under test can tell."""


def test_a_job_killed_while_cutting_the_metrics_back_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    def killed_mid_write(self: Path, data: str, *args: object, **kwargs: object) -> int:
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", killed_mid_write)
        with pytest.raises(Killed):
            MetricsWriter(path, enabled=True, keep_until=4)
    assert read_records(path) == records  # the rerun cuts them as it should
    MetricsWriter(path, enabled=True, keep_until=4)
    assert read_records(path) == records[:4]


def test_a_second_follow_run_into_a_held_run_folder_is_refused_before_waiting(
    tmp_path: Path,
) -> None:
    out, never = tmp_path / "run", tmp_path / "store-not-yet-extracted"
    sets = [f"data.store={never}", f"run.out={out}", "data.follow=true"]
    sets += ["data.follow_poll_s=0.01", "data.follow_timeout_s=0.05"]  # it was: the wait's error
    out.mkdir()
    refused = pytest.raises(ValueError, match="another `dflash train` is writing this run")
    with exclusive_lock(out / RUN_LOCK, RuntimeError), refused:  # a first training holds it
        run_train(build_config(TrainConfig, DEBUG, "train", sets))


def test_tensorboard_drops_the_steps_of_a_run_killed_before_its_first_checkpoint(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def job(losses: list[float]) -> Trackers:
        trackers = Trackers(["tensorboard"], tmp_path, project="p", name=None, config={})
        for step, loss in enumerate(losses, start=1):
            trackers.log({"step": step, "loss": loss})
        return trackers

    job([9.0, 8.0, 7.0])  # killed: no checkpoint, never closed (each step is flushed)
    job([3.0, 2.0, 1.0, 0.5]).close()  # the rerun starts from step 1
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 3.0),
        (2, 2.0),
        (3, 1.0),
        (4, 0.5),
    ]
