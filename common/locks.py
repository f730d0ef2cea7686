"""An exclusive writer lock on a file: an OS lock (flock) that the kernel releases when the
holder exits or is killed, so a crashed run never leaves a stale lock behind.

The lock file holds the holder's pid, host and start time, so a refused writer can say who
holds it. It is emptied, not removed, on release: removing a lock file lets a waiting process
lock a file that a third one then replaces (two holders). Used by `dflash extract` (one per
store) and `dflash generate` (one per output folder).
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


def holder_of(fd: int) -> str:
    """Who holds the lock of `fd`, from what the holder wrote into the file."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on host {who['host']}, since {who['since']}"
    except (ValueError, KeyError, TypeError):  # the holder has not written it yet
        return "pid and host not yet written"


@contextmanager
def exclusive_lock(path: Path, refused: Callable[[str], Exception]) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed); when another process holds it,
    raise `refused(holder)` with the holder's pid, host and start time."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise refused(holder_of(fd)) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.ctime()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock (as the kernel does when a holder dies)
