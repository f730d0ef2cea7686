"""Stopping a training run early without losing a step.

A scheduler's preemption notice (SIGTERM: SLURM before its kill, Kubernetes, `timeout`), a
first Ctrl-C (SIGINT) or `run.time_limit_s` do not kill the run where it stands: the step in
flight finishes, the run checkpoints that step and exits with a `Stopped` error whose exit code
says why (128 + the signal's number, as a shell reports a signal; 124 for the time limit, as
`timeout` does). Rerunning the same command resumes from that checkpoint. A Ctrl-C after a
stop signal (SIGTERM or a first Ctrl-C) stops at once (KeyboardInterrupt), losing the steps
since the last checkpoint.

With several ranks the signal may reach them at different steps (the launcher forwards it), so
each step the ranks agree on whether to stop (one all-reduce of one number): all of them stop
after the same step and the checkpoint is whole. With run.read_metrics_late that agreement is
read a step later, like the metrics, and the run stops one step after the request. The same
number carries a rank's held failure (RANK_FAILED, common.distributed.HeldFailure): rank 0's
per-step writes reach the other ranks at no cost of their own.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from common.errors import Stopped
from stage2_train.host_copy import HostCopy

TIME_LIMIT_EXIT = 124
# a rank holds a failure: above every exit code (0-255), so the MAX of the agreement keeps it
RANK_FAILED = 256
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequests:
    """Records a stop signal or the time limit; `due()` says, after a step, whether to stop.

    Use as a context manager: the handlers are installed for the loop and the previous ones put
    back after it (a process running several jobs, e.g. the tests, keeps its own)."""

    def __init__(self, time_limit_s: float | None, device: torch.device, world_size: int) -> None:
        self.time_limit_s, self.device, self.world_size = time_limit_s, device, world_size
        self.started = time.monotonic()
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._agreed: HostCopy | None = None  # due(late=True): the last call's agreement

    def __enter__(self) -> StopRequests:
        # signal handlers can only be set from the main thread (a worker thread runs unguarded)
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C after a stop signal: stop now
        if self.signal is None:
            self.signal = signum
            hint = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            # one write(2) call, not the logger or print: the handler may have interrupted either
            # mid-write, and a buffered stream refuses a reentrant write
            line = (
                f"{signal.Signals(signum).name}: stopping after this step with a checkpoint{hint}"
            )
            os.write(2, f"{line}\n".encode())

    def _local_code(self) -> int:
        if self.signal is not None:
            return 128 + self.signal
        if self.time_limit_s is not None and time.monotonic() - self.started >= self.time_limit_s:
            return TIME_LIMIT_EXIT
        return 0

    def due(self, late: bool = False, failed: bool = False) -> int:
        """0 to go on, else the exit code to stop with; every rank calls it after every step
        and all of them get the same answer. With several ranks the answer is a collective;
        `late` takes the one agreed at the previous call (0 at the first) and leaves this
        call's to the next, so the host need not wait for this step's kernels to learn it:
        the run stops one step later, still all ranks after the same step. `failed`: this
        rank holds a failure; RANK_FAILED then comes back on every rank (in place of a code)."""
        code = RANK_FAILED if failed else self._local_code()
        if self.world_size == 1 or not dist.is_initialized():
            return code
        agreed = torch.full((1,), code, dtype=torch.int32, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if not late:
            return int(agreed.item())
        previous, self._agreed = self._agreed, HostCopy(agreed)
        return int(previous.read().item()) if previous is not None else 0


def stopped(code: int, step: int, total_steps: int, checkpoint: str | None) -> Stopped:
    """The error a stopped run exits with: why, where it stopped, and how to go on
    (`checkpoint` None: no step was trained, nothing to save)."""
    if code == TIME_LIMIT_EXIT:
        why = "run.time_limit_s reached"
    else:
        why = f"{signal.Signals(code - 128).name} received"
    if checkpoint is None:
        where = f"stopped before its first step of {total_steps}; rerun the same command to start"
    else:
        where = (
            f"stopped after step {step} of {total_steps} with a checkpoint in {checkpoint}; "
            "rerun the same command to resume from it"
        )
    return Stopped(f"{why}: {where}", exit_code=code)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: a loader worker leaves SIGTERM and SIGINT to its trainer.

    `timeout` and a terminal's Ctrl-C signal the whole process group; a worker that died of it
    would make the trainer fail on its next batch instead of checkpointing. The trainer shuts
    its workers down itself, and a worker whose trainer is gone exits on its own."""
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
