"""Durable commits: flush a finished temporary folder to disk before renaming it into place.

A rename is atomic for the processes of one machine, but after a power or node failure the
directory entry can reach the disk before the files' data. Flushing every file and folder of
the temporary tree first, then the parent folder after the rename, makes "the folder exists"
mean "its content is on disk" in that case too.

`replace_folder` commits a folder over an existing one with no moment without it (a swap in one
step where the system has one; else two renames back to back, and `recover_aside` for a kill
between them).

`space_checked` turns a disk full (ENOSPC, EDQUOT) or a file-size limit (EFBIG) met while
writing such a folder into one OutOfSpaceError naming the folder, the space needed and the fix.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flush_tree(tmp: Path) -> None:
    """fsync every file and folder under `tmp`, and `tmp` itself."""
    for path in sorted(tmp.rglob("*")):
        if path.is_file() or path.is_dir():
            fsync_path(path)
    fsync_path(tmp)


def commit_folder(tmp: Path, final: Path, before_rename: Callable[[], None] | None = None) -> None:
    """fsync every file and folder under `tmp`, rename it to `final`, fsync the parent.
    `before_rename` runs after the flush, just before the rename: it raises to call it off."""
    _flush_tree(tmp)
    if before_rename is not None:
        before_rename()
    os.rename(tmp, final)
    fsync_path(final.parent)


def aside_name(final: Path) -> Path:
    """Where `replace_folder` moves an old `final` aside, where it cannot swap the two."""
    return final.with_name(".tmp-old-" + final.name)


def recover_aside(final: Path) -> bool:
    """Rename `.tmp-old-NAME` back to a missing `final`, and say whether it did: a kill between
    the two renames of `replace_folder` (where it cannot swap, and in versions before the swap)
    left the old `final`, whole, only there. For `final`'s writer, or a reader holding its
    writer's lock: a writer between its two renames would find `final` taken and fail."""
    aside = aside_name(final)
    if final.exists() or not aside.is_dir():
        return False
    aside.rename(final)
    fsync_path(final.parent)
    return True


def replace_folder(tmp: Path, final: Path) -> None:
    """Commit `tmp` as `final`, replacing a `final` that exists whole, with no moment without
    a complete `final`: `tmp` is flushed, then the two are swapped in one step (Linux's
    renameat2 exchange) and the old one, now at `tmp`'s name, removed (a kill before that
    leaves it as its writer's temporary folder, which the writer removes next time). Where the
    system cannot swap, the old one is moved aside as `.tmp-old-NAME` just before `tmp`'s
    rename, nothing in between, and removed after; `recover_aside` renames it back should a
    kill fall between the two renames (it does so here first)."""
    recover_aside(final)
    if not final.exists():
        commit_folder(tmp, final)
        return
    _flush_tree(tmp)
    if _exchange(tmp, final):
        fsync_path(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    aside = aside_name(final)
    shutil.rmtree(aside, ignore_errors=True)
    final.rename(aside)  # nothing between these two renames (the flush came first)
    os.rename(tmp, final)
    fsync_path(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
# what renameat2 answers where the kernel (ENOSYS) or the file system (EINVAL: NFS, ...)
# cannot exchange: replace_folder falls back to two renames
NO_EXCHANGE_ERRNOS = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing entries in one atomic step (renameat2 with RENAME_EXCHANGE, glibc
    2.28+ on Linux 3.15+); False where the C library, kernel or file system has none."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):  # another C library, or another system
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in NO_EXCHANGE_ERRNOS:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


# A disk full, a quota or a file-size limit: the write cannot succeed until the user acts.
NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class OutOfSpaceError(OSError):
    """No room to write `folder`: the message names the folder, the space needed and the fix."""

    def __init__(self, err_no: int, message: str) -> None:
        super().__init__(err_no, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


@contextmanager
def space_checked(what: str, folder: Path, needed_bytes: int, fix: str) -> Iterator[None]:
    """Turn a disk-full or file-size-limit OSError raised while writing `folder` into an
    OutOfSpaceError naming `what`, the folder, the space needed and `fix`."""
    try:
        yield
    except OSError as err:
        if err.errno not in NO_SPACE_ERRNOS or isinstance(err, OutOfSpaceError):
            raise
        try:
            free = f", {_gb(shutil.disk_usage(folder.parent).free)} free there"
        except OSError:
            free = ""
        reason = "file-size limit hit" if err.errno == errno.EFBIG else "no space left"
        raise OutOfSpaceError(
            err.errno,
            f"{reason} writing {what} {folder} (needs about {_gb(needed_bytes)}{free}); {fix}",
        ) from err
