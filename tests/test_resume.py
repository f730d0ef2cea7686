"""Resuming `dflash train`: a damaged newest checkpoint falls back to the previous one with a
warning; another config is refused with its differences, or applied with
--allow-config-change (except what a resume can never change)."""

from __future__ import annotations

import json
import logging
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from log_capture import dflash_messages
from rank_pair import run_in_pair
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.logging import get_logger
from stage2_train import schedule
from stage2_train.checkpoint import TrainState, resume_latest, save_checkpoint
from stage2_train.config import OptimConfig, TrainConfig
from stage2_train.schedule import build_optimizer, lr_factor
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
SETS = ["optim.max_steps=6", "run.checkpoint_every=2", "run.keep_checkpoints=5"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("resume") / "store", FactorySpec(num_sequences=9))


@pytest.fixture
def warnings() -> list[str]:
    """The dflash logger's warnings (it does not propagate to pytest's caplog)."""
    with dflash_messages(logging.WARNING) as seen:
        yield seen


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false", *SETS]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def interrupted_after_step_4(store: Path, out: Path) -> list[dict]:
    """A full run, then what a run killed right after step 4's checkpoint would have left."""
    full = train(store, out)
    for name in ("step-000006", "export"):
        for path in sorted((out / name).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (out / name).rmdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:4]))
    return full


@pytest.mark.parametrize("damage", ["truncated", "missing", "rng_missing", "bad_json"])
def test_damaged_newest_checkpoint_falls_back(tmp_path: Path, damage: str, warnings) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        save_checkpoint(tmp_path, TrainState(step, 0, step), **objects, config={}, rank=0, keep=2)
    newest = tmp_path / "step-000002"
    if damage == "truncated":
        (newest / "model.pt").write_bytes((newest / "model.pt").read_bytes()[:100])
    elif damage == "missing":
        (newest / "optimizer.pt").unlink()
    elif damage == "rng_missing":  # a rank's own file: it would go on with the state it had
        (newest / "rng-rank0.pt").unlink()
    else:
        (newest / "meta.json").write_text('{"train_state": ')
    state, _, path = resume_latest(
        tmp_path, lambda meta, path: None, **objects, rank=0, device=torch.device("cpu")
    )
    assert (state.step, path.name) == (1, "step-000001")
    assert torch.equal(model.weight, torch.ones(2, 3))
    what = {
        "truncated": "model.pt is unreadable",
        "missing": "optimizer.pt is missing",
        "rng_missing": "rng-rank0.pt is missing",
    }
    [warning] = warnings
    assert f"step-000002/{what.get(damage, 'meta.json is unreadable')}" in warning
    assert "falling back to" in warning and warning.endswith("step-000001")
    # rank 1 of checkpoints that rank 0 wrote alone: no RNG state of its own in either
    with pytest.raises(ValueError, match=r"step-000001/rng-rank1.pt is missing\); move them"):
        resume_latest(tmp_path, lambda m, p: None, **objects, rank=1, device=torch.device("cpu"))
    (tmp_path / "step-000001" / "model.pt").unlink()
    with pytest.raises(ValueError, match="every checkpoint in .* is damaged"):
        resume_latest(tmp_path, lambda m, p: None, **objects, rank=0, device=torch.device("cpu"))


def _resume_as_rank(rank: int, folder: Path, store_file: str, seen: multiprocessing.Queue) -> None:
    """Rank `rank` of 2 (gloo): resume_latest on `folder`; puts (rank, (its path, its
    warnings))."""
    dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank, world_size=2)
    logged: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    try:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        get_logger().addHandler(handler)
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        _, _, path = resume_latest(
            folder, lambda m, p: None, **objects, rank=rank, device=torch.device("cpu")
        )
        seen.put((rank, (path.name, logged)))
    finally:
        get_logger().removeHandler(handler)  # the pair's process runs other tests' jobs next
        dist.destroy_process_group()


def test_another_ranks_missing_rng_file_is_named_where_rank_0_logs(tmp_path: Path) -> None:
    """Rank 1's rng-rank1.pt missing from the newest checkpoint: both ranks fall back to the
    previous one, and rank 0's warning names that file (it said "damaged on another rank")."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    for step in (1, 2):  # as 2 ranks would write them: rank 1's RNG state beside rank 0's
        save_checkpoint(tmp_path, TrainState(step, 0, step), **objects, config={}, rank=0, keep=2)
        folder = tmp_path / f"step-{step:06d}"
        (folder / "rng-rank1.pt").write_bytes((folder / "rng-rank0.pt").read_bytes())
    (tmp_path / "step-000002" / "rng-rank1.pt").unlink()
    seen = run_in_pair(_resume_as_rank, tmp_path, str(tmp_path / "store"))
    results = sorted((rank, name, logged) for rank, (name, logged) in seen.items())
    assert [(r, name) for r, name, _ in results] == [(0, "step-000001"), (1, "step-000001")]
    [warning] = results[0][2]
    assert "step-000002/rng-rank1.pt is missing; falling back to" in warning, warning


def test_truncated_newest_checkpoint_resumes_from_the_previous(
    store: Path, tmp_path: Path, warnings
) -> None:
    out = tmp_path / "run"
    full = interrupted_after_step_4(store, out)
    model = out / "step-000004" / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 3])
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:2]))
    resumed = train(store, out)
    assert any("step-000004/model.pt is unreadable" in w for w in warnings)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]  # from step 2, exactly
    assert torch.load(model, weights_only=True)  # written again, whole


def test_leftover_checkpoint_folders_are_removed_when_a_run_resumes(
    store: Path, tmp_path: Path
) -> None:
    """Temporary checkpoint folders of a killed run whose steps are never saved again (a save
    at a cadence since changed, one moved aside, a prune) go as the next run starts, named in
    its log; the checkpoints stay."""
    out = tmp_path / "run"
    interrupted_after_step_4(store, out)
    leftovers = [".tmp-old-step-000002", ".tmp-pruned-step-000001", ".tmp-step-000005"]
    for name in leftovers:
        (out / name).mkdir()
        (out / name / "model.pt").write_bytes(b"half")
    with dflash_messages(logging.INFO) as logged:
        train(store, out)
    assert not list(out.glob(".tmp-*"))
    steps = sorted(p.name for p in out.glob("step-*"))
    assert steps == ["step-000002", "step-000004", "step-000006"]
    assert any(line.endswith(f"left in {out}: {', '.join(leftovers)}") for line in logged)


def test_wsd_schedule_reaches_the_optimizer(store: Path, tmp_path: Path) -> None:
    rows = train(store, tmp_path / "run", "optim.schedule=wsd", "optim.decay_ratio=0.5")
    warmup, floor = 0.04, 0.0  # debug.yaml keeps the defaults
    total = rows[-1]["step"]
    for row in rows:
        expected = 0.003 * lr_factor(row["step"] - 1, total, warmup, floor, "wsd", 0.5)
        assert row["lr"] == pytest.approx(expected, rel=1e-6), row
    assert rows[-1]["lr"] == 0.0 and len({r["lr"] for r in rows}) > 2


def test_changed_lr_refused_then_applied_with_the_flag(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    interrupted_after_step_4(store, out)
    with pytest.raises(ValueError, match=r"other settings: optim.lr: 0.003 -> 0.1; rerun with "):
        train(store, out, "optim.lr=0.1")
    # the drafter's shape can never change, flag or not
    with pytest.raises(ValueError, match=r"cannot change: drafter.num_layers: 2 -> 3"):
        train(store, out, "optim.lr=0.1", "drafter.num_layers=3", "run.allow_config_change=true")
    rows = train(store, out, "optim.lr=0.1", "optim.max_steps=8", "run.allow_config_change=true")
    assert [r["step"] for r in rows] == list(range(1, 9))
    warmup, floor = 0.04, 0.0  # debug.yaml keeps the defaults
    for row in rows[4:]:  # the new peak lr and length, from the resumed step on
        expected = 0.1 * lr_factor(row["step"] - 1, 8, warmup, floor)
        assert row["lr"] == pytest.approx(expected, rel=1e-6), row
    meta = json.loads((out / "step-000008" / "meta.json").read_text())
    assert meta["config"]["optim"]["lr"] == 0.1


def test_read_metrics_late_may_change_on_resume(store: Path, tmp_path: Path) -> None:
    """When a step's metrics are read changes no number: a resume may switch it freely."""
    out = tmp_path / "run"
    full = interrupted_after_step_4(store, out)
    rows = train(store, out, "run.read_metrics_late=false")
    assert [r["loss"] for r in rows] == [r["loss"] for r in full]


def test_weight_decay_spares_the_norm_weights() -> None:
    """optim.weight_decay shrinks the matrices only: with zero gradients an AdamW step moves
    nothing but the decay, and the RMSNorm weights (vectors) keep their value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.RMSNorm(4))
    cfg = OptimConfig(weight_decay=0.5)
    optimizer = build_optimizer(list(model.parameters()), cfg, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    matrix, norm = model.parameters()
    assert torch.allclose(matrix, before[0] * (1 - cfg.lr * 0.5))
    assert torch.equal(norm, before[1])


def test_single_group_checkpoint_resumes_exactly(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose AdamW had one parameter group (before the weight-decay groups)
    resumes into today's groups with every moment where it was: the same losses as a run that
    never stopped."""
    full = train(store, tmp_path / "full")
    out = tmp_path / "run"
    with monkeypatch.context() as patch:  # the old optimizer: one group of every parameter
        patch.setattr(schedule, "param_groups", lambda params, decay: params)
        interrupted_after_step_4(store, out)
    optimizer = torch.load(out / "step-000004" / "optimizer.pt", weights_only=True)
    assert len(optimizer["param_groups"]) == 1
    resumed = train(store, out)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    optimizer = torch.load(out / "step-000006" / "optimizer.pt", weights_only=True)
    assert [g["decay"] for g in optimizer["param_groups"]] == [True, False]


def test_weight_decay_applied_on_resume_spares_the_norms(store: Path, tmp_path: Path) -> None:
    """--allow-config-change to a weight decay reaches the matrices' group only."""
    out = tmp_path / "run"
    interrupted_after_step_4(store, out)
    train(store, out, "optim.weight_decay=0.1", "run.allow_config_change=true")
    saved = torch.load(out / "step-000006" / "optimizer.pt", weights_only=True)
    decays = {g["decay"]: g["weight_decay"] for g in saved["param_groups"]}
    assert decays == {True: 0.1, False: 0.0}


def test_resume_keeps_the_random_state_of_the_uninterrupted_run(
    store: Path, tmp_path: Path
) -> None:
    """Every global RNG (torch, numpy, python) at the resumed run's last checkpoint is where the
    uninterrupted run's was: nothing the resume does draws from them after they are restored
    (a loader's iterator drew its workers' base seed from torch's)."""
    train(store, tmp_path / "full")
    out = tmp_path / "run"
    interrupted_after_step_4(store, out)
    train(store, out)
    full, resumed = (
        torch.load(run / "step-000006" / "rng-rank0.pt", weights_only=False)
        for run in (tmp_path / "full", out)
    )
    assert torch.equal(resumed["torch"], full["torch"])
    assert resumed["python"] == full["python"]
    assert all(
        (a == b).all() if hasattr(a, "shape") else a == b
        for a, b in zip(resumed["numpy"], full["numpy"], strict=True)
    )
