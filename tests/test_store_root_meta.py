"""The store's root zarr.json read and written: damage gives a StoreError naming the file, and a
rewrite reaches the disk before it replaces the old one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common.store import StoreError, read_root_attrs
from stage1_extract import store_root


@pytest.mark.parametrize(
    "text", ["[1, 2]", '"a string"', "3", '{"zarr_format": 3, "attributes": [1]}', "null"]
)
def test_a_root_that_is_json_but_not_zarr_metadata_is_a_store_error(
    tmp_path: Path, text: str
) -> None:
    """Valid JSON of another shape (an edit by hand, another tool's file) raised AttributeError
    ('list' object has no attribute 'get'), a traceback instead of the message naming the store."""
    (tmp_path / "zarr.json").write_text(text)
    with pytest.raises(StoreError, match=str(tmp_path)):
        read_root_attrs(tmp_path)


def test_write_root_attrs_flushes_the_new_file_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut after the rename but before the data reached the disk leaves an empty
    zarr.json on file systems that order metadata before data (XFS, ext4 without auto_da_alloc):
    the temporary file is fsynced, then the folder after the rename."""
    (tmp_path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1]
    )
    store_root.write_root_attrs(tmp_path, {"version": 2})
    assert events == ["fsync", "replace", "fsync"]
    assert read_root_attrs(tmp_path) == {"version": 2}
