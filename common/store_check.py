"""Every shard of a store checked before a reader starts (`dflash train`, `dflash convert`,
`dflash evaluate-offline`).

Two kinds of damage, both found from JSON and `stat` alone (no array data is read):
- its files against the sizes recorded at commit (store_files.py: zarr reads a deleted file as
  zeros, and a cut one fails only when decoded, hours into a run);
- its metadata against the root attributes: the sequence count the plan gives that shard, and
  each array the reader reads present, parsed as zarr parses it, of the FORMAT.md dtype and
  shape (a foreign or damaged shard whose sizes agree with its own record).
One StoreError names every damaged shard of either kind, a line per problem, and the fix, so
one round of deleting shard folders and rerunning `dflash extract` repairs the store.

    check_shards(open_store(store), ["tokens", "hidden", ...])   # StoreError: every bad shard
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from zarr.core.metadata.v3 import ArrayV3Metadata

from common.logging import get_logger
from common.store import (
    FILES_KEY,
    SHARD_ATTR,
    StoreError,
    StoreInfo,
    layout_mismatch,
    shard_layout,
    shard_name,
    shards_dir,
)
from common.store_files import GROUP_META, STAT_THREADS, file_problems

MAX_DETAILED = 20  # problems spelled out in check_shards' error; the rest by shard


def expected_sequences(info: StoreInfo, index: int) -> int | None:
    """Sequences shard `index` holds by the plan (FORMAT.md: the last may hold fewer); None for
    the last shard of an unfinished store, whose count comes with the store's counts."""
    per_shard = int(info.attrs["sequences_per_shard"])
    if not info.complete:
        return per_shard if index < info.num_shards - 1 else None
    return min(per_shard, int(info.attrs["counts"]["sequences"]) - index * per_shard)


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> SimpleNamespace:
    """The dtype and shape of an array's zarr.json text, parsed as zarr parses it when it opens
    the array (codecs checked against the shape and dtype, so metadata zarr would refuse fails
    here). Cached by text: a store's shards share their arrays' metadata byte for byte (but the
    last shard's), and zarr's parse costs ~0.3 ms where reading the file costs ~20 us."""
    meta = ArrayV3Metadata.from_dict(json.loads(text))
    return SimpleNamespace(dtype=meta.dtype.to_native_dtype(), shape=tuple(meta.shape))


def shard_problems(info: StoreInfo, index: int, names: list[str]) -> tuple[list[str], bool]:
    """What is wrong with shard `index` of `info`'s store for a reader of arrays `names`, as
    "shard-NNNNNN[ array A]: what" lines ([] when nothing is), and whether the shard had file
    sizes recorded to check (format version 1 did not record them)."""
    name = shard_name(index)
    folder = shards_dir(info.path) / name
    try:
        attrs = json.loads((folder / GROUP_META).read_text())["attributes"][SHARD_ATTR]
        num_sequences, num_documents = attrs["num_sequences"], attrs["num_documents"]
    except FileNotFoundError:
        gone = "folder is missing" if not folder.is_dir() else f"{GROUP_META} is missing"
        return [f"{name}: {gone}"], True
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{name}: {GROUP_META} unreadable ({type(err).__name__}: {err})"], True
    expected = expected_sequences(info, index)
    if expected is not None and num_sequences != expected:
        return [f"{name}: {num_sequences} sequences, expected {expected}"], True
    recorded = attrs.get(FILES_KEY)
    damaged = file_problems(folder, recorded or {})
    problems = [f"{name} array {array}: {what}" for array, what, _ in damaged]
    cut = {array for array, _, _ in damaged}  # their files are named: their metadata may be gone
    for array, (dtype, shape) in shard_layout(info, num_sequences, num_documents).items():
        if array not in names or array in cut:
            continue
        meta = folder / array / "zarr.json"
        try:
            found = _parsed(meta.read_text())
        except FileNotFoundError:
            problems.append(f"{name} array {array}: missing (no {array}/zarr.json)")
            continue
        except Exception as err:  # OSError, JSON, and zarr's many types for metadata it refuses
            what = f"{array}/zarr.json unreadable ({type(err).__name__}: {err})"
            problems.append(f"{name} array {array}: {what}")
            continue
        if what := layout_mismatch(found, dtype, shape):
            problems.append(f"{name} array {array}: {what}")
    return problems, recorded is not None


def check_shards(info: StoreInfo, names: list[str], shards: list[int] | None = None) -> None:
    """Every shard of `info`'s store (or each of `shards`) present, its recorded files there
    with their recorded sizes, holding the sequences the plan gives it and arrays `names` of
    the dtype and shape its root attributes give them; else one StoreError naming every bad
    shard, a line per problem, and the fix (`damage_error`)."""
    indices = list(range(info.num_shards)) if shards is None else shards
    if bad := damaged_shards(info, names, indices):
        raise damage_error(info, bad, len(indices))


def damaged_shards(info: StoreInfo, names: list[str], indices: list[int]) -> dict[int, list[str]]:
    """{shard: its problem lines} for each of `indices` that `shard_problems` finds wrong.
    Shards without a file record (written before format version 2) have their metadata
    checked only, with a log line."""
    with ThreadPoolExecutor(STAT_THREADS) as pool:  # latency-bound on network file systems
        found = list(pool.map(lambda i: shard_problems(info, i, names), indices))
    if unrecorded := sum(not checked for _, checked in found):
        get_logger().info(
            "store %s: %d of %d shards were written before format version 2 recorded file "
            "sizes; their files are not checked before reading",
            info.path,
            unrecorded,
            len(indices),
        )
    return {index: lines for index, (lines, _) in zip(indices, found, strict=True) if lines}


def damage_error(info: StoreInfo, bad: dict[int, list[str]], num_checked: int) -> StoreError:
    """One error for the bad shards of `damaged_shards`: the first MAX_DETAILED problems in
    full, the rest's shards as spans, and the fix."""
    problems = [(index, line) for index, lines in bad.items() for line in lines]
    listed = [line for _, line in problems[:MAX_DETAILED]]
    if rest := problems[MAX_DETAILED:]:
        listed.append(f"and {len(rest)} more problems, in {_spans(sorted({i for i, _ in rest}))}")
    return StoreError(
        f"store {info.path}: {len(bad)} of {num_checked} shards do not hold what its root "
        "attributes and their own file records promise (found before reading, from their "
        "metadata and file sizes):\n  - "
        + "\n  - ".join(listed)
        + f"\ndelete each shard folder named above under {shards_dir(info.path)} and rerun the "
        "same `dflash extract` command, which rebuilds only the missing shards (`dflash inspect "
        f"verify {info.path}` checks every value of every shard)"
    )


def _spans(indices: list[int]) -> str:
    """Sorted shard indices as names, runs joined: "shard-000003, shard-000007 to shard-000009"."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(
        shard_name(a) if a == b else f"{shard_name(a)} to {shard_name(b)}" for a, b in runs
    )
