"""The arrays of one shard that the loader reads, opened once per worker, and their rows.

A row's arrays are decoded straight from their files into the caller's buffers
(stage2_train/row_reader.py); an array of a layout the direct reader does not know is read
through zarr. Bytes that cannot be trusted (a chunk that fails to decode or to checksum, a file
missing or of another size than recorded at commit: zarr would read it as zeros) raise
`Damaged`, whose one line names the store, the shard, the array and the fix.

An array's metadata (present, of the dtype and shape the root attributes give it) and every
shard's file sizes are checked for every shard before training by `check_shards`
(common/store_check.py: JSON and stat only), so a foreign or damaged shard stops the run at its
start, not hours in at its first read; the same checks in `ShardRows.open` and after each read
stay as the backstop (a shard changed after the start).

    shard = ShardRows.open(store_info, 3, ["tokens", "hidden", ...])   # Damaged if unreadable
    rows = shard.read(row, {"tokens": out_S, ...})                    # Damaged if damaged
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync as zarr_sync

from common.store import (
    REEXTRACT,
    SHARD_ATTR,
    StoreInfo,
    layout_mismatch,
    shard_layout,
    shard_name,
    shards_dir,
)
from common.store_files import file_problems, recorded_files
from stage2_train.row_reader import RowReader


class Damaged(Exception):
    """A sequence that cannot be read; the message names the shard, the array and the fix."""


def damaged(root: Path, index: int, array: str, what: str) -> Damaged:
    return Damaged(f"store {root}: {shard_name(index)} array {array}: {what}; {REEXTRACT}")


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


class ShardRows:
    """The named arrays of one shard: zarr handles, direct readers, recorded file sizes."""

    def __init__(self, root: Path, index: int, arrays: dict[str, zarr.Array], recorded: dict):
        self.root, self.index, self.arrays = root, index, arrays
        self.folder = shards_dir(root) / shard_name(index)
        self.readers = {name: RowReader.of(a, self.folder / name) for name, a in arrays.items()}
        # the recorded sizes of the files read ({} for shards from before format v2)
        self.files = {rel: size for rel, size in recorded.items() if rel.split("/")[0] in arrays}
        self.sizes = [(str(self.folder / rel), size) for rel, size in self.files.items()]

    @classmethod
    def open(cls, info: StoreInfo, index: int, names: list[str]) -> ShardRows:
        """Shard `index` of the store `info` (its root read once, by the caller), its arrays
        `names` opened; Damaged if its
        folder, metadata or an array cannot be opened, or an array's dtype or shape is not the
        one FORMAT.md gives it in this store (its rows would be read as other values, or fail
        with an error that says nothing of the store)."""
        root = Path(info.path)
        path = shards_dir(root) / shard_name(index)
        if not path.is_dir():
            raise damaged(root, index, "-", f"shard folder {path} is missing")
        try:
            recorded = recorded_files(path) or {}
            group = zarr.open_group(path, mode="r", zarr_format=3)
            num_sequences = int(group.attrs[SHARD_ATTR]["num_sequences"])
        except Exception as err:  # zarr raises many types for damaged metadata
            raise damaged(root, index, "-", f"unreadable ({type(err).__name__}: {err})") from err
        layout = shard_layout(info, num_sequences, 0)
        arrays = {}
        for name in names:
            try:
                arrays[name] = group[name]
            except Exception as err:
                what = f"unreadable ({type(err).__name__}: {err})"
                raise damaged(root, index, name, what) from err
            if what := layout_mismatch(arrays[name], *layout[name]):
                raise damaged(root, index, name, what)
        return cls(root, index, arrays, recorded)

    def read(self, row: int, into: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Row `row` of every array, decoded into `into`'s arrays (one per array, [S, ...] of
        its dtype); Damaged when its bytes cannot be trusted."""
        slow = [name for name, reader in self.readers.items() if reader is None]
        values = {}
        if slow:  # other layouts: zarr, all of them in one trip to its event loop
            reads = zarr_sync(_read_rows([self.arrays[name] for name in slow], row))
            values = dict(zip(slow, reads, strict=True))
        for name, reader in self.readers.items():
            try:  # checksum, codec, short-file errors: many types
                if reader is not None:
                    reader.read_into(row, into[name])
                elif isinstance(values[name], Exception):
                    raise values[name]
                else:
                    into[name][...] = values[name]
            except Exception as err:
                what = f"cannot be decoded ({type(err).__name__}: {err})"
                raise damaged(self.root, self.index, name, what) from err
        # after the read: a file deleted or cut since the pre-check read as zeros, silently
        changed = any(_size(path) != size for path, size in self.sizes)  # the cheap check
        if changed and (problems := file_problems(self.folder, self.files)):
            raise damaged(self.root, self.index, *problems[0][:2])
        return {name: into[name] for name in self.readers}


async def _read_rows(arrays: Iterable[zarr.Array], row: int) -> list[Any]:
    """Row `row` of each array, read concurrently in one trip to zarr's event loop (a row's
    ~10 arrays cost ~1-2 ms each in zarr's per-read overhead, one `array[row]` at a time: 23
    vs 29 ms a pystd row, bench/loader_cost.py); an array's error comes back as its value."""
    reads = (array.async_array.getitem(row) for array in arrays)
    return await asyncio.gather(*reads, return_exceptions=True)
