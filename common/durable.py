"""Durable commits: flush a finished temporary folder to disk before renaming it into place.

A rename is atomic for the processes of one machine, but after a power or node failure the
directory entry can reach the disk before the files' data. Flushing every file and folder of
the temporary tree first, then the parent folder after the rename, makes "the folder exists"
mean "its content is on disk" in that case too.
"""

from __future__ import annotations

import os
from pathlib import Path


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_folder(tmp: Path, final: Path) -> None:
    """fsync every file and folder under `tmp`, rename it to `final`, fsync the parent."""
    for path in sorted(tmp.rglob("*")):
        if path.is_file() or path.is_dir():
            _fsync_path(path)
    _fsync_path(tmp)
    os.rename(tmp, final)
    _fsync_path(final.parent)
