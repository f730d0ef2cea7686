"""Start-up for multi-process work on torch.distributed.

`dflash extract` / `dflash train` launch one process per listed device through torchrun's own
launcher API (`torch.distributed.launcher.elastic_launch`), so the same worker function runs
unchanged under `torchrun` on many nodes. A worker calls `init_worker()` to join the group and
pick its device.

Process-group timeout: a rank that waits in a collective (a barrier, an all-reduce) for longer
than the group's timeout fails (NCCL's watchdog kills it; torch's default for NCCL is 10 min).
Ranks wait that way whenever one of them works alone or longer: rank 0 tokenizing before
extraction, the slowest rank finishing its share of shards or chunks, rank 0's evaluation on
the dev store, checkpoint and export while the other ranks of `dflash train` wait in the next
all-reduce. Each command therefore sets the timeout explicitly, to a default that covers its
longest such wait, and `DFLASH_DIST_TIMEOUT_S` (seconds) overrides it for all three.

A section that one rank does alone (rank 0 writing or removing files) ends in
`failure_shared()` rather than a bare barrier: an error there reaches the other ranks at once,
not when their next collective times out. A section where every rank works long on its own
share (generate's chunks, extract's shards) asks `another_rank_failed()` between two units of
it, so a rank stops at its next unit once another has failed rather than finishing its share
first.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from common.errors import Stopped, user_message

T = TypeVar("T")


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """True when started by torchrun (or our own launch), which sets these variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def parse_devices(devices: str | list[int] | list[str]) -> list[str]:
    """'0,1' / [0, 1] -> ['cuda:0', 'cuda:1']; 'cpu' or 'cpu,cpu' -> CPU processes."""
    if isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
    else:
        items = [str(d) for d in devices]
    if not items:
        raise ValueError("--devices is empty; give GPU ids like 0,1 or 'cpu'")
    out = []
    for item in items:
        if item == "cpu":
            out.append("cpu")
        elif item.isdigit():
            out.append(f"cuda:{item}")
        elif item.startswith("cuda:") and item[5:].isdigit():
            out.append(item)
        else:
            raise ValueError(f"--devices entry {item!r} is not a GPU id (0, 1, ...) or 'cpu'")
    gpus = [d for d in out if d != "cpu"]
    twice = sorted({d for d in gpus if gpus.count(d) > 1})
    if twice:
        # each listed GPU is one process's: two on one GPU fail in NCCL's set-up, after the
        # output folder exists, or share its memory
        raise ValueError(
            f"--devices {','.join(items)} lists {', '.join(twice)} more than once; list each GPU "
            "once (one process per GPU)"
        )
    if gpus:
        available = torch.cuda.device_count()
        missing = [d for d in gpus if int(d.split(":")[1]) >= available]
        if missing:
            # the list may be the config's run.devices, which the user never typed: name both
            asked = f"the devices {','.join(items)} (--devices, or run.devices in the config)"
            if available == 0:
                raise ValueError(
                    f"{asked} ask for {missing}, but this machine has no CUDA GPU; "
                    "pass --devices cpu"
                )
            raise ValueError(
                f"{asked} ask for {missing}, but this machine has {available} GPU(s), ids "
                f"0..{available - 1}; pass existing ids, e.g. --devices 0, or --devices cpu"
            )
        if "cpu" in out:
            raise ValueError("--devices mixes 'cpu' and GPUs; use one or the other")
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TIMEOUT_ENV = "DFLASH_DIST_TIMEOUT_S"


def dist_timeout(default: timedelta | None) -> timedelta | None:
    """The process-group timeout: `$DFLASH_DIST_TIMEOUT_S` seconds when set, else `default`
    (None: torch's own)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return default
    try:
        if (seconds := float(value)) > 0:
            return timedelta(seconds=seconds)
    except (ValueError, OverflowError):  # not a number; inf
        pass
    raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a positive number of seconds")


def launch(worker: Callable[..., Any], devices: list[str], *args: Any) -> None:
    """Run `worker(*args)` once per device, as torchrun would; inline when already under torchrun
    or when there is a single device (no process group needed then)."""
    dist_timeout(None)  # a malformed DFLASH_DIST_TIMEOUT_S is refused before any worker starts
    if under_torchrun() or len(devices) == 1:
        worker(*args)
        return
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["DFLASH_DEVICES"] = ",".join(devices)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=len(devices),
        run_id=f"dflash-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    elastic_launch(config, worker)(*args)


def local_device(listed: list[str], local: int, local_world: int) -> str:
    """The device of local rank `local` of `local_world` processes on this node: its listed
    GPU, or the CPU for every rank when only the CPU is listed (it is no per-rank device, so
    `--devices cpu` runs unchanged under `torchrun --nproc_per_node N`)."""
    if all(d == "cpu" for d in listed):
        return "cpu"
    if len(listed) < local_world:  # refused on every rank alike, before the process group
        ids = ",".join(d.removeprefix("cuda:") for d in listed)
        raise ValueError(
            f"--devices lists {len(listed)} GPU(s) ({ids}) but torchrun starts {local_world} "
            f"processes on this node, one per GPU: list {local_world} GPU ids (e.g. --devices "
            f"{','.join(map(str, range(local_world)))}) or start torchrun with --nproc_per_node "
            f"{len(listed)}"
        )
    return listed[local]


def init_worker(devices: list[str], timeout: timedelta | None = None) -> WorkerContext:
    """Join the process group (if any) and choose this process's device.

    Under torchrun, local rank i takes the i-th listed device (`local_device`).
    `timeout`: the command's default for the longest wait of one rank for another in a
    collective (see the module docstring); `$DFLASH_DIST_TIMEOUT_S` overrides it.
    """
    if not under_torchrun():
        device = torch.device(devices[0])
        if device.type == "cuda":
            # streams, events and allocations without an explicit device go here too
            torch.cuda.set_device(device)
        return WorkerContext(0, 1, 0, device)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    launched = os.environ.get("DFLASH_DEVICES")
    listed = launched.split(",") if launched else devices
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
    device = torch.device(local_device(listed, local, local_world))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = dist_timeout(timeout)
        extra = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group(
            backend=backend, device_id=device if backend == "nccl" else None, **extra
        )
    return WorkerContext(rank, world, local, device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_from_all_ranks(value: T) -> list[T]:
    """Every rank's `value`, by rank (collective: every rank must call it); `[value]` without
    a process group."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


class RankFailed(RuntimeError):
    """Another rank failed in a section that every rank ends together (`failure_shared`)."""


# the process-group store key of the innermost failure_shared section this process is in
# (None: in none), under which a rank that failed there says so as it fails; every rank enters
# the sections in the same order (each ends in a collective), so the keys agree across ranks
_section_key: str | None = None
_sections_entered = 0
# exit code of a rank stopped because another was interrupted: 128 + SIGINT, as a shell reports
INTERRUPTED_EXIT = 130


@contextmanager
def failure_shared() -> Iterator[None]:
    """Run the body, then meet every rank as `barrier()` does, saying whether it failed there:
    an Exception of the body on any rank is raised on every rank, on the first rank that failed
    as itself, on the others as a RankFailed with that rank's message (its own error, if any,
    as the cause). Without it a rank whose part failed left the others waiting in their next
    collective until the process-group timeout (hours). Without a process group: the body.
    A failing rank also marks the section failed on the group's store before it waits, for
    the others' `another_rank_failed()`.

    A rank interrupted in the body (Ctrl-C: KeyboardInterrupt) marks the section too, leaves
    its word under `<key>-left` and stops at once, meeting no one. The others stop at their
    next unit of work (`another_rank_failed`) and end with `Stopped` (exit 130), their own
    error if any as its cause (a writer refused its commit once the lock's holder was gone),
    without waiting in the meeting for it: on another node, which its torchrun does not end, a
    rank used to work through its whole share first, then fail there (hours; on NCCL perhaps
    waiting until the timeout). A rank already in the meeting learns it from the broken
    collective (gloo at once); a store that is gone (torchrun's first node stopped) ends every
    rank likewise, named."""
    global _section_key, _sections_entered
    _sections_entered += 1
    outer, _section_key = _section_key, f"dflash-failure-shared-{_sections_entered}"
    key, own = _section_key, None
    try:
        yield
    except Exception as err:
        own = err
        if dist.is_initialized():
            with suppress(dist.DistError):  # the store is gone: the meeting below says so
                _group_store().set(key, str(dist.get_rank()))
    except BaseException as err:
        if dist.is_initialized():
            with suppress(dist.DistError):  # the store is gone: so is the run
                how = "interrupted (Ctrl-C, SIGINT)"
                if not isinstance(err, KeyboardInterrupt):
                    how = f"stopped ({type(err).__name__}: {err})"
                _group_store().set(f"{key}-left", f"rank {dist.get_rank()} was {how}")
                _group_store().set(key, str(dist.get_rank()))
        raise
    finally:
        _section_key = outer
    if not dist.is_initialized():
        if own is not None:
            raise own
        return
    said = None if own is None else user_message(own) or f"{type(own).__name__}: {own}"
    if (left := _left_without_meeting(key)) is None:
        try:
            gathered = gather_from_all_ranks(said)
        except Exception as err:  # the collective broke: a rank is gone from it
            broken = err
        else:
            failed = [(rank, text) for rank, text in enumerate(gathered) if text]
            if not failed:
                return
            first, text = failed[0]
            if own is not None and first == dist.get_rank():
                raise own
            raise RankFailed(f"rank {first} failed, so every rank stops: {text}") from own
        if (left := _left_without_meeting(key)) is None:
            if own is not None:
                raise own
            raise _gone(broken) from broken
    raise left from own


def _left_without_meeting(key: str) -> Exception | None:
    """What every rank ends with when one left section `key` without meeting the others (its
    `-left` word on the store, or the store gone), else None."""
    try:
        if not _group_store().check([f"{key}-left"]):
            return None
        said = _group_store().get(f"{key}-left").decode()
    except dist.DistError as err:
        return _gone(err)
    return Stopped(
        f"{said}, so every rank stopped; rerun the same command to resume (what was saved is kept)",
        INTERRUPTED_EXIT,
    )


def _gone(err: Exception) -> RankFailed:
    return RankFailed(
        f"the ranks could not meet ({type(err).__name__}: {err}): a rank is gone without a "
        "word (killed: SIGKILL, the out-of-memory killer; its node lost) or stuck, or torchrun's "
        "first node (the store's host) stopped, so every rank stops; see the other ranks' logs, "
        "then rerun the same command to resume (what was saved is kept)"
    )


def _group_store() -> dist.Store:
    # torch's own (private) accessor for the key-value store every rank of the default group
    # joined through (torchrun's TCPStore, a test's FileStore): no collective, no rank waits
    return dist.distributed_c10d._get_default_store()


def another_rank_failed() -> bool:
    """Inside failure_shared: whether a rank has already failed, or was interrupted, in this
    section (one look-up on the process group's store, not a collective: ranks may ask it a
    different number of times). A rank with long work of its own left stops at its next unit
    of it when this says so and leaves the body, so the section's end raises that rank's error
    on every rank at once, instead of after this rank's whole share. A store that cannot be
    reached (its host, torchrun's first node, stopped) raises RankFailed naming it: a rank that
    merely stopped its share there would end its section as if its work were done. False
    outside a section or without a process group."""
    if _section_key is None or not dist.is_initialized():
        return False
    try:
        return _group_store().check([_section_key])
    except dist.DistError as err:
        raise _gone(err) from err


class HeldFailure:
    """An error of this rank's own per-step work (rank 0's metrics line, its trackers), held
    until the ranks next meet instead of raised where it happened.

    Raised at once, it ended this rank while the others waited for it in their next step's
    collectives until the process-group timeout; sharing it at once (failure_shared) would add
    a collective to every step. Held, the rank trains on with the others (skipping the failed
    work), the flag `failed` rides on a collective the step already does (the stop agreement,
    stage2_train/stop.py), and `share()`, called by every rank where they meet (that
    agreement, a checkpoint, the end), ends every rank with this rank's error. Without a
    process group (world 1) the error is raised at once, as before."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.error: Exception | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def run(self, work: Callable[..., Any], *args: Any) -> None:
        """`work(*args)`, its error held; skipped once an error is held (a metrics line after
        the failed one would leave a gap in the file that a resume cannot see)."""
        if self.error is not None:
            return
        try:
            work(*args)
        except Exception as err:
            if self.world_size == 1 or not dist.is_initialized():
                raise
            self.error = err

    def raise_held(self) -> None:
        """Raise the held error, if any; inside failure_shared every rank then stops with it."""
        if self.error is not None:
            raise self.error

    def share(self) -> None:
        """Every rank: end them all with the first held error (collective: one gather of
        nothing per call while nothing failed)."""
        with failure_shared():
            self.raise_held()


def finish_worker() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
