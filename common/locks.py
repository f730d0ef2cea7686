"""An exclusive writer lock on a file: an OS lock (flock) that the kernel releases when the
holder exits or is killed, so a crashed run never leaves a stale lock behind.

The lock file holds the holder's pid, host and start time, so a refused writer can say who
holds it. It is emptied, not removed, on release: removing a lock file lets a waiting process
lock a file that a third one then replaces (two holders). Used by `dflash extract` (one per
store) and `dflash generate` (one per output folder).

An flock belongs to the open file, not to the process: a process given a copy of the holder's
descriptor (`held_lock_fd`) keeps the lock held until it has exited too, even if the holder is
killed. Extract's writer processes hold one, so no other run can start while one of them lives
(stage1_extract/writer_pools.py). The other processes of the run have no copy (a launch's GPU
processes, torchrun's ranks but 0): handed the text the holder wrote (`exclusive_lock` yields
it), they ask `lock_holder` whether the file still names it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_held: dict[str, int] = {}  # the descriptors of the locks this process holds, by absolute path


def held_lock_fd(path: Path) -> int | None:
    """The descriptor of the lock on `path` while this process holds it (`exclusive_lock`)."""
    return _held.get(os.path.abspath(path))


def holder_of(fd: int) -> str:
    """Who holds the lock of `fd`, from what the holder wrote into the file."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on host {who['host']}, since {who['since']}"
    except (ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "pid and host not yet written"


def lock_holder(path: Path) -> str | None:
    """What the holder of the lock on `path` wrote into it, None while no process holds it.
    Probed with a shared, non-blocking flock released at once: it is taken only while no one
    holds the lock, so a run starting in that instant (refused, rerun) is all it can disturb."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 4096, 0).decode(errors="replace")
    finally:
        os.close(fd)  # also releases the probe's lock when it was taken
    return None


@contextmanager
def exclusive_lock(path: Path, refused: Callable[[str], Exception]) -> Iterator[str]:
    """Hold an exclusive lock on `path` (created if needed), yielding what this process wrote
    into it (what `lock_holder` returns while it holds it); when another process holds it,
    raise `refused(holder)` with the holder's pid, host and start time."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise refused(holder_of(fd)) from None
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.ctime()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        _held[os.path.abspath(path)] = fd
        try:
            yield me
        finally:
            del _held[os.path.abspath(path)]
            os.ftruncate(fd, 0)
    finally:
        # releases the lock (as the kernel does when a holder dies), once no copy of `fd` is open
        os.close(fd)
