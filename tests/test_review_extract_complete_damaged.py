"""`dflash extract` rerun over a complete store whose shard was cut since: refused with the
shard, the file and the fix (it used to log the store complete again), and once the shard's
folder is deleted as the fix says, the rerun rebuilds it byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_runs import tiny_extract_config

from common.store import StoreError, open_store
from stage1_extract.run import run_extract


def test_a_cut_shard_stops_the_rerun_until_its_folder_is_deleted(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    cfg = tiny_extract_config(tiny_qwen3, tmp_path)  # the default hidden_dtype: nvfp4
    store = tmp_path / "store"
    run_extract(cfg)
    shards = sorted((store / "shards").iterdir())
    assert len(shards) >= 2, shards
    last = shards[-1]
    kept = tmp_path / "kept"
    shutil.copytree(last, kept)
    chunk = next(p for p in sorted((last / "hidden").rglob("*")) if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:10])

    with pytest.raises(StoreError) as refused:
        run_extract(cfg)
    message = str(refused.value)
    assert f"{last.name} array hidden: file hidden/" in message, message
    assert "is 10 bytes" in message, message
    assert "delete each shard folder" in message and "rerun the same `dflash extract`" in message
    assert all(s.name not in message for s in shards[:-1]), message  # only the cut one

    shutil.rmtree(last)
    run_extract(cfg)
    assert open_store(store).attrs["complete"] is True
    rebuilt = {p.relative_to(last): p.read_bytes() for p in last.rglob("*") if p.is_file()}
    original = {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    assert rebuilt.keys() == original.keys()
    differing = [str(p) for p in rebuilt if rebuilt[p] != original[p]]
    # the shard's zarr.json may record its own commit time; every array's bytes are the same
    assert all(p.endswith("zarr.json") for p in differing), differing
