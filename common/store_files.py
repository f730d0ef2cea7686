"""The file sizes of each shard, recorded at commit and checked by readers (FORMAT.md, v2).

Zarr reads a missing chunk or shard file as the fill value (zeros) without an error, and a
truncated one fails only when it is decoded, hours into a run. So the writer records the size of
every file of a shard in its attributes (`dflash_shard.files`) just before the commit, and
`dflash train` and `dflash convert` stat every recorded file of every shard they read before
reading any (store_check.py `check_shards`): one `stat` per file, no decoding, seconds for
thousands of shards. Shards written before format version 2 have no record and are counted and
skipped.

    record_shard_files(tmp_shard_folder)           # writer, after the arrays, before the rename
    file_problems(folder, recorded_files(folder))  # reader: [] when every file is whole
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.store import (
    FILES_KEY,
    REEXTRACT,
    SHARD_ATTR,
    StoreError,
)

GROUP_META = "zarr.json"  # the shard group's own metadata: holds the record, so not in it
# stat() is latency-bound on network file systems: a few threads hide it
STAT_THREADS = 16


def shard_files(folder: Path) -> dict[str, int]:
    """{path relative to the shard folder: size in bytes} of every file but the group's zarr.json."""
    sizes = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != GROUP_META:
            sizes[rel] = path.stat().st_size
    return sizes


def record_shard_files(folder: Path) -> dict[str, int]:
    """Write the sizes of the shard's files into its `dflash_shard` attributes; return them."""
    meta = folder / GROUP_META
    doc = json.loads(meta.read_text())
    sizes = shard_files(folder)
    doc["attributes"][SHARD_ATTR][FILES_KEY] = sizes
    meta.write_text(json.dumps(doc, indent=2))
    return sizes


def recorded_files(folder: Path) -> dict[str, int] | None:
    """The shard's recorded sizes, or None for a shard written before they were recorded.
    StoreError if its metadata is missing or unreadable."""
    try:
        doc = json.loads((folder / GROUP_META).read_text())
        attrs = doc["attributes"][SHARD_ATTR]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StoreError(
            f"shard {folder.name} of store {folder.parent.parent}: metadata {GROUP_META} "
            f"unreadable ({type(err).__name__}: {err}); {REEXTRACT}"
        ) from err
    return attrs.get(FILES_KEY)


def file_problems(folder: Path, recorded: dict[str, int]) -> list[tuple[str, str, bool]]:
    """(array, what is wrong, whether the file is missing) for each recorded file of the shard
    that is missing or whose size differs from the one recorded at commit; the array is the
    path's first part."""
    problems = []
    for rel, size in recorded.items():
        array = rel.split("/", 1)[0]
        try:
            found = os.stat(folder / rel).st_size
        except FileNotFoundError:
            problems.append((array, f"file {rel} is missing (it would read as zeros)", True))
            continue
        if found != size:
            problems.append((array, f"file {rel} is {found} bytes, {size} when committed", False))
    return problems
