"""A failure in a checkpoint step that rank 0 does alone reaches every rank at once: rank 0
removing what a killed run left (remove_leftovers), creating the checkpoint's temporary
folder, writing its model, pruning an old one. The other ranks used to wait in the barrier
after it until the process-group timeout (two hours for `dflash train`); now each raises at
once with rank 0's reason, the path and the fix. Two gloo ranks under a 10 s timeout, so a
regression fails in seconds instead of hanging (3 s was too tight for a loaded 2-core machine:
one scenario took longer there with the fix in place)."""

from __future__ import annotations

import errno
import multiprocessing
import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rank_pair import run_in_pair

from common.distributed import HeldFailure
from stage2_train.checkpoint import TrainState, remove_leftovers, save_checkpoint

TIMEOUT_S = 10.0
# what rank 0 is made to fail at; the expected path (in the run folder) and fix of its error
SCENARIOS = {
    "leftovers": (".tmp-step-000007", "then rerun the same command"),
    "mkdir": (".tmp-step-000002", "then rerun the same command to resume from step-000001"),
    "write": ("step-000002", "free space on that disk, then rerun the same command"),
    "prune": (".tmp-pruned-step-000001", "step-000002 is saved whole"),
}


def _refused(path: object) -> PermissionError:
    return PermissionError(errno.EACCES, "Permission denied", str(path))


def _inject(patch: pytest.MonkeyPatch, scenario: str) -> None:
    """Make rank 0's part of `scenario` fail as a real disk or folder would."""
    rmtree, save = shutil.rmtree, torch.save

    def rmtree_refused(path: Path, ignore_errors: bool = False) -> None:
        if ignore_errors:  # the save's own cleanups of folders that may not exist
            return rmtree(path, ignore_errors=True)
        raise _refused(path)

    def mkdir_refused(self: Path, *args: object, **kwargs: object) -> None:
        raise _refused(self)

    def disk_full(obj: object, f: Path, *args: object, **kwargs: object) -> None:
        if Path(f).name == "model.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        save(obj, f, *args, **kwargs)

    if scenario in ("leftovers", "prune"):
        patch.setattr(shutil, "rmtree", rmtree_refused)
    elif scenario == "mkdir":
        patch.setattr(Path, "mkdir", mkdir_refused)
    else:
        patch.setattr(torch, "save", disk_full)


def _save(out: Path, step: int, rank: int) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    save_checkpoint(out, TrainState(step, 0, step), **objects, config={}, rank=rank, keep=1)


def _meet(root: Path, name: str, rank: int) -> None:
    """Wait for the other rank to reach `name` too, through files (no collective)."""
    (root / f"{name}-{rank}").touch()
    deadline = time.monotonic() + 30
    while not (root / f"{name}-{1 - rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _as_rank(rank: int, root: Path, seen: multiprocessing.Queue) -> None:
    """Rank `rank` of 2: each scenario in turn, each in a process group of its own, which both
    ranks leave together (a rank that failed alone would otherwise meet the other in the next
    scenario's collectives); puts (rank, {scenario: (error, seconds)})."""
    outcomes = {}
    for scenario in SCENARIOS:
        store = dist.FileStore(str(root / f"store-{scenario}"), 2)
        timeout = timedelta(seconds=TIMEOUT_S)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        started = time.perf_counter()
        try:
            with pytest.MonkeyPatch.context() as patch:
                if rank == 0:
                    _inject(patch, scenario)
                if scenario == "leftovers":
                    remove_leftovers(root / scenario, rank)
                else:
                    _save(root / scenario, 2, rank)
            error = "none"
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        outcomes[scenario] = (error, time.perf_counter() - started)
        _meet(root, f"done-{scenario}", rank)
        dist.destroy_process_group()
    seen.put((rank, outcomes))


def test_a_failure_of_rank_0_alone_fails_every_rank_at_once(tmp_path: Path) -> None:
    for scenario in SCENARIOS:
        out = tmp_path / scenario
        if scenario == "leftovers":
            (out / ".tmp-step-000007").mkdir(parents=True)  # a killed run's save
        else:  # the checkpoint a rerun would resume from
            _save(out, 1, 0)
    outcomes = run_in_pair(_as_rank, tmp_path, timeout=6 * TIMEOUT_S * len(SCENARIOS))
    for scenario, (name, fix) in SCENARIOS.items():
        path = str(tmp_path / scenario / name)
        own, took_0 = outcomes[0][scenario]
        told, took_1 = outcomes[1][scenario]
        assert "rank 0" in told and path in told and fix in told, (scenario, told)
        assert max(took_0, took_1) < TIMEOUT_S, (scenario, took_0, took_1)
        assert path in own and fix in own, (scenario, own)
    assert not list((tmp_path / "write").glob(".tmp-*"))  # the half-written save is gone


def test_without_a_process_group_the_error_is_rank_0s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single process raises as before (its own PermissionError, no RankFailed), now with
    the fix in its message."""
    (tmp_path / ".tmp-step-000007").mkdir()
    _inject(monkeypatch, "leftovers")
    with pytest.raises(PermissionError, match=r"\.tmp-step-000007; remove that folder"):
        remove_leftovers(tmp_path, rank=0)


def test_a_held_failure_without_a_process_group_is_raised_at_once() -> None:
    """One rank has no one to wait for it: rank 0's per-step write fails where it happened,
    as before HeldFailure (nothing is held for a later stop agreement)."""
    held = HeldFailure(world_size=1)
    with pytest.raises(OSError, match="No space left on device"):
        held.run(_refused_line, {"step": 1})
    assert not held.failed


def _refused_line(record: dict) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", "metrics.jsonl")
