"""The file sizes of each shard, recorded at commit and checked by readers (FORMAT.md, v2).

Zarr reads a missing chunk or shard file as the fill value (zeros) without an error, and a
truncated one fails only when it is decoded, hours into a run. So the writer records the size of
every file of a shard in its attributes (`dflash_shard.files`) just before the commit, and
`dflash train` stats every recorded file of every shard before step 1 (`check_store_files`):
one `stat` per file, no decoding, seconds for thousands of shards. Shards written before
format version 2 have no record and are counted and skipped.

    record_shard_files(tmp_shard_folder)   # writer, after the arrays, before the rename
    check_store_files(open_store(store))   # reader, before training
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.logging import get_logger
from common.store import (
    FILES_KEY,
    REEXTRACT,
    SHARD_ATTR,
    StoreError,
    StoreInfo,
    shard_name,
    shards_dir,
)

GROUP_META = "zarr.json"  # the shard group's own metadata: holds the record, so not in it
# stat() is latency-bound on network file systems: a few threads hide it
STAT_THREADS = 16
MAX_LISTED = 5  # damaged files named in one error; the rest are counted


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


def _check_shard(store: Path, index: int) -> tuple[list[str], bool]:
    """Problems of one shard as message parts, and whether it had a record to check."""
    folder = shards_dir(store) / shard_name(index)
    if not folder.is_dir():
        return [f"{folder.name}: missing"], True
    try:
        recorded = recorded_files(folder)
    except StoreError as err:
        return [f"{folder.name}: {err}"], True
    if recorded is None:
        return [], False
    found = file_problems(folder, recorded)
    return [f"{folder.name} array {array}: {what}" for array, what, _ in found], True


def check_store_files(info: StoreInfo, shards: list[int] | None = None) -> None:
    """Every planned shard (or each of `shards`) present, every recorded file there with its
    recorded size; else one StoreError naming the shards, arrays and files, and the fix.
    Shards without a record (written before format version 2) are skipped, with a log line."""
    store = info.path
    indices = range(info.num_shards) if shards is None else shards
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        results = list(pool.map(lambda i: _check_shard(store, i), indices))
    problems = [p for found, _ in results for p in found]
    unrecorded = sum(not checked for _, checked in results)
    if unrecorded:
        get_logger().info(
            "store %s: %d of %d shards were written before format version 2 recorded file "
            "sizes; their files are not checked before training",
            store,
            unrecorded,
            len(indices),
        )
    if problems:
        listed = "; ".join(problems[:MAX_LISTED])
        more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise StoreError(
            f"store {store} is damaged: {listed}{more}; delete each shard folder named under "
            f"{shards_dir(store)} and rerun the same `dflash extract` command to rebuild them"
        )
