"""commit_folder flushes every file and folder before the rename, then the parent after it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.durable import commit_folder


def test_commit_flushes_then_renames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tmp_path / ".tmp-x"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(b"a")
    (tmp / "sub" / "b.bin").write_bytes(b"b")
    final = tmp_path / "x"
    synced: list[tuple[str, bool]] = []
    real_fsync, real_open = os.fsync, os.open
    names: dict[int, str] = {}

    def spy_open(path, flags, *args):  # remember which path each descriptor is
        fd = real_open(path, flags, *args)
        names[fd] = str(path)
        return fd

    def spy_fsync(fd: int) -> None:
        synced.append((names.get(fd, "?"), final.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    commit_folder(tmp, final)
    assert not tmp.exists() and (final / "sub" / "b.bin").read_bytes() == b"b"
    before = {name for name, renamed in synced if not renamed}
    assert {str(tmp / "a.bin"), str(tmp / "sub"), str(tmp / "sub" / "b.bin"), str(tmp)} <= before
    assert synced[-1] == (str(tmp_path), True)  # the parent, after the rename
