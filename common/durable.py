"""Durable commits: flush a finished temporary folder to disk before renaming it into place.

A rename is atomic for the processes of one machine, but after a power or node failure the
directory entry can reach the disk before the files' data. Flushing every file and folder of
the temporary tree first, then the parent folder after the rename, makes "the folder exists"
mean "its content is on disk" in that case too.

`space_checked` turns a disk full (ENOSPC, EDQUOT) or a file-size limit (EFBIG) met while
writing such a folder into one OutOfSpaceError naming the folder, the space needed and the fix.
"""

from __future__ import annotations

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


def commit_folder(tmp: Path, final: Path, before_rename: Callable[[], None] | None = None) -> None:
    """fsync every file and folder under `tmp`, rename it to `final`, fsync the parent.
    `before_rename` runs after the flush, just before the rename: it raises to call it off."""
    for path in sorted(tmp.rglob("*")):
        if path.is_file() or path.is_dir():
            fsync_path(path)
    fsync_path(tmp)
    if before_rename is not None:
        before_rename()
    os.rename(tmp, final)
    fsync_path(final.parent)


def replace_folder(tmp: Path, final: Path) -> None:
    """Commit `tmp` as `final`, replacing a `final` that exists whole: it is moved aside first
    and removed after, so no moment is left without a complete `final` (a kill in between
    leaves the old one beside, as `.tmp-old-NAME`)."""
    aside = final.with_name(".tmp-old-" + final.name)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    commit_folder(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


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
