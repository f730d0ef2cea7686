"""The process-group timeout: every command sets it (`dflash train` had torch's default, 10
minutes for NCCL, while its other ranks wait in an all-reduce for rank 0's dev evaluation,
checkpoint and export), DFLASH_DIST_TIMEOUT_S overrides it and governs a real wait of 2 gloo
ranks. (That the ranks of `dflash train --follow` wait for the same shards, so that none sits in
a collective while another waits for extraction, is tested in test_follow.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import common.distributed as distributed
import stage1_extract.run as extract_run
import stage1_generate.run as generate_run
import stage2_train.train as train
from common.distributed import launch

REPO = Path(__file__).parents[1]
TIMEOUT_ENV = "DFLASH_DIST_TIMEOUT_S"


class Joined(Exception):
    """Raised by the recorded init_process_group: the worker stops right after joining."""


@pytest.fixture
def torchrun_rank0(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Rank 0 of 2 under torchrun; returns the keyword arguments init_process_group gets."""
    calls: list[dict] = []
    monkeypatch.delenv("DFLASH_DEVICES", raising=False)
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    for name, value in (("RANK", 0), ("WORLD_SIZE", 2), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 2)):
        monkeypatch.setenv(name, str(value))

    def record(**kwargs: object) -> None:
        calls.append(kwargs)
        raise Joined

    monkeypatch.setattr(distributed.dist, "init_process_group", record)
    return calls


WORKERS = {
    "train": (lambda: train._worker(None, ["cpu"]), timedelta(hours=2)),
    "extract": (lambda: extract_run._worker(None, ["cpu"], None, None), timedelta(hours=48)),
    "generate": (lambda: generate_run._worker(None, ["cpu"], "-", False), timedelta(hours=48)),
}


@pytest.mark.parametrize("command", sorted(WORKERS))
@pytest.mark.parametrize("env", [None, "90"])
def test_each_command_gives_init_process_group_its_timeout(
    torchrun_rank0, monkeypatch, command, env
):
    """Each worker joins with its command's timeout, or DFLASH_DIST_TIMEOUT_S seconds when
    set; train used to pass none (torch's default: 10 minutes for NCCL)."""
    if env is not None:
        monkeypatch.setenv(TIMEOUT_ENV, env)
    worker, default = WORKERS[command]
    with pytest.raises(Joined):
        worker()
    assert [c["backend"] for c in torchrun_rank0] == ["gloo"]
    assert torchrun_rank0[0]["timeout"] == (default if env is None else timedelta(seconds=90))


@pytest.mark.parametrize("value", ["ten", "0", "-5", "inf", "nan"])
def test_a_malformed_timeout_is_refused_before_any_worker_starts(monkeypatch, value):
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}=.* is not a positive number of seconds"):
        distributed.dist_timeout(timedelta(hours=2))
    started = []
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        launch(lambda: started.append(1), ["cpu", "cpu"])
    assert not started
    monkeypatch.setenv(TIMEOUT_ENV, " 1.5 ")
    assert distributed.dist_timeout(None) == timedelta(seconds=1.5)


# One of 2 gloo ranks under torchrun's variables: rank 0 works alone for WORK_S, then both meet
# in an all-reduce, as train's ranks after rank 0's dev evaluation or export. A plain script:
# it imports only common.distributed, so each rank starts in about a second.
RANK_SCRIPT = """
import os, sys, time, traceback
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from common.distributed import finish_worker, init_worker

rank, out, work_s = int(os.environ["RANK"]), Path(sys.argv[1]), float(sys.argv[2])
(out / f"started-{rank}").touch()
while not (out / f"started-{1 - rank}").exists():  # both imported: they join together
    time.sleep(0.01)
try:
    init_worker(["cpu"], timeout=timedelta(hours=2))
    if rank == 0:
        time.sleep(work_s)
    value = torch.ones(1)
    dist.all_reduce(value)
    (out / f"rank-{rank}.txt").write_text(f"ok {value.item():g}")
except Exception:
    (out / f"rank-{rank}.txt").write_text(traceback.format_exc())
finally:
    finish_worker()
"""


def _start_two_ranks(out: Path, timeout_s: str, work_s: float) -> list[subprocess.Popen]:
    out.mkdir()
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", TIMEOUT_ENV: timeout_s}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(distributed._free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(out), str(work_s)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]


def _outcomes(out: Path, procs: list[subprocess.Popen]) -> dict[int, str]:
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a safety net only
            p.kill()
            p.wait()
    return {r: (out / f"rank-{r}.txt").read_text() for r in range(2)}


def test_the_configured_timeout_governs_a_wait_for_rank_0(tmp_path: Path) -> None:
    """Rank 0 works alone for 2.5 s: with DFLASH_DIST_TIMEOUT_S=1 rank 1's all-reduce times
    out (so the setting reaches the real group: unread, torch's 30 minutes for gloo let it
    pass), with 30 both ranks go on. Both pairs run at once."""
    short, long = tmp_path / "short", tmp_path / "long"
    started = {short: _start_two_ranks(short, "1", 2.5), long: _start_two_ranks(long, "30", 2.5)}
    timed_out = _outcomes(short, started[short])[1]
    assert "ok" not in timed_out and "timed out" in timed_out.lower(), timed_out
    assert _outcomes(long, started[long]) == {0: "ok 2", 1: "ok 2"}
