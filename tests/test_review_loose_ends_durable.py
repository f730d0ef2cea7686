"""`replace_folder` and a kill: it moved the old folder aside, flushed the new one (seconds for
a large export), then renamed it into place, so a kill in that window left only
`.tmp-old-NAME`; export-best's reader then found no best.json and the run's first evaluation
replaced the best drafter with a worse one. Now the new folder is flushed first and the two are
swapped in one step (or, where the system cannot swap, renamed back to back), and
`recover_aside` renames a left-behind `.tmp-old-NAME` back, as export-best's reader does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import common.durable as durable
from common.durable import aside_name, recover_aside, replace_folder
from stage2_train.best import BEST_DIR, BEST_FILE, best_record, best_so_far, dev_definition


def _folder(path: Path, text: str) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "f.txt").write_text(text)
    return path


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "two_renames"])
def test_final_is_there_at_every_flush_and_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    final = _folder(tmp_path / "export", "old")
    tmp = _folder(tmp_path / ".tmp-export", "new")
    seen: list[bool] = []
    real_fsync = durable.fsync_path

    def spy_fsync(path: Path) -> None:
        seen.append(final.exists())
        real_fsync(path)

    monkeypatch.setattr(durable, "fsync_path", spy_fsync)
    if not swap:  # a file system without renameat2's exchange (NFS, ...)
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    replace_folder(tmp, final)
    assert (final / "sub" / "f.txt").read_text() == "new"
    assert not tmp.exists() and not aside_name(final).exists()
    assert len(seen) >= 4 and all(seen)  # before: the new folder was flushed with none there


def test_a_kill_between_the_renames_is_recovered(tmp_path: Path) -> None:
    final = tmp_path / "export"
    aside = _folder(aside_name(final), "old")  # what a kill between the renames left
    assert recover_aside(final) and (final / "sub" / "f.txt").read_text() == "old"
    assert not aside.exists() and not recover_aside(final)  # nothing left to recover
    _folder(aside, "older")  # an aside beside a whole final is not taken for it
    assert not recover_aside(final) and (final / "sub" / "f.txt").read_text() == "old"


def test_export_best_reader_renames_the_best_back(tmp_path: Path) -> None:
    """A run killed while export-best/ was replaced: its resume starts from that best, not
    from none (which let its first evaluation export a worse drafter over it)."""
    best = tmp_path / BEST_DIR
    best.mkdir()
    definition = dev_definition(16, [2])
    (best / BEST_FILE).write_text(best_record(300, 2.5, "/dev-store", "key", definition))
    os.rename(best, aside_name(best))
    assert best_so_far(tmp_path, "/dev-store", "key", definition) == 2.5
    assert json.loads((best / BEST_FILE).read_text())["step"] == 300
    assert not aside_name(best).exists()
    assert best_so_far(tmp_path / "none", "/dev-store", "key", definition) == -math.inf
