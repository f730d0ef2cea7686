"""`dflash convert STORE OUT.h5`: a store's arrays and attributes as one HDF5 file.

Each array of the selected shards is concatenated along its first axis, in shard order, into
one dataset of the same name (`/tokens` [n, S], `/hidden` [n, S, K, D], `/doc_length` [P],
...), so `f["hidden"][i]` is sequence i and the `doc_*` datasets load straight into a pandas
DataFrame. `/index` says where each shard's rows lie; the root attribute `dflash` holds the
store's root attributes as JSON (FORMAT.md, "HDF5 files" documents the layout).

The store is read shard by shard and each array in blocks of at most BLOCK_BYTES, so memory
stays bounded whatever the store's size; the file is written beside OUT under a temporary name
and renamed into place at the end, so an interrupted run never leaves a half file at OUT.

Legend: n sequences, S tokens per sequence, K tapped layers, D hidden size, P documents.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import zarr
from safetensors import safe_open
from tqdm import tqdm

from common.durable import NO_SPACE_ERRNOS, space_checked
from common.logging import get_logger
from common.store import (
    DOCUMENT_ARRAYS,
    FILES_KEY,
    HEAD_FILE,
    REEXTRACT,
    SHARD_ATTR,
    StoreError,
    StoreInfo,
    bits_to_bf16,
    committed_shards,
    decode_scaled_hidden,
    open_store,
    sequence_array_specs,
    shard_name,
    shards_dir,
)
from common.store_check import check_shards

HDF5_FORMAT = "dflash-offline-hdf5"
LAYOUT_VERSION = 1
BLOCK_BYTES = 64 << 20  # read from the store at once, per array: bounds memory
CHUNK_BYTES = 1 << 20  # target size of one HDF5 chunk (h5py's guidance: 10 KiB - 1 MiB)
HEAD = "target_head"  # the group (and the --arrays name) of the target's embedding, norm, head
BITS_ARRAYS = ("hidden", "logits")  # bf16 (or fp8) bits in the store
HIDDEN_AS = ("bits", "float32", "float16")
COMPRESSIONS = ("gzip", "lzf", "none")
# root attributes also written as plain HDF5 attributes, for tools that do not parse JSON
PLAIN_ATTRS = ("seq_len", "hidden_size", "vocab_size", "topk", "tapped_layers", "hidden_dtype")
PLAIN_ATTRS += ("sequences_per_shard", "num_shards", "full_logits")


def parse_shards(text: str | None, committed: list[int], store: Path) -> list[int]:
    """`0-3,7` -> [0, 1, 2, 3, 7] (None: every committed shard); ValueError naming the bad part
    or the shards the store does not hold."""
    if text is None:
        return committed
    wanted: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(
                f"--shards {text!r}: {part!r} is not a shard number or range; use e.g. 0-3,7"
            ) from None
        if last < first:  # an empty range: the store's error said to run extract first
            raise ValueError(
                f"--shards {text!r}: {part.strip()!r} is an empty range; write it low-high, "
                f"e.g. {last}-{first}"
            )
        wanted.update(range(first, last + 1))
    if missing := sorted(wanted - set(committed)):
        raise ValueError(
            f"--shards {text!r}: store {store} has no committed shards {missing[:10]} (it holds "
            f"{len(committed)}: 0-{max(committed, default=0)}); choose among those"
        )
    return sorted(wanted)


def parse_arrays(text: str | None, info: StoreInfo) -> list[str]:
    """The arrays to write (None: all); hidden_scale comes with hidden in fp8 stores."""
    known = [*sequence_array_specs(info.hidden_dtype, info.attrs["full_logits"]), *DOCUMENT_ARRAYS]
    if text is None:
        return [*known, HEAD]
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:  # it wrote a file of the index and attributes alone
        raise ValueError(
            f"--arrays {text!r} names no array; name some of {', '.join([*known, HEAD])}, or "
            "leave --arrays out to write all"
        )
    if unknown := [n for n in names if n not in (*known, HEAD)]:
        raise ValueError(
            f"--arrays: store {info.path} has no array {', '.join(unknown)}; choose among "
            f"{', '.join([*known, HEAD])}"
        )
    if "hidden" in names and "hidden_scale" in known and "hidden_scale" not in names:
        names.append("hidden_scale")  # fp8 bits are meaningless without their scales
    return names


def _filters(compression: str) -> dict[str, Any]:
    """h5py dataset options of a compression choice; shuffle groups the bytes of each value,
    which is what makes float and int arrays compress."""
    if compression == "none":
        return {}
    return {"compression": compression, "shuffle": True}


def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """About CHUNK_BYTES per chunk: whole rows when a row is smaller, else a span of tokens."""
    if 0 in shape:
        return None  # h5py refuses chunks on empty datasets
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    if row <= CHUNK_BYTES or len(shape) == 1:
        return (max(1, min(shape[0], CHUNK_BYTES // max(row, 1))), *shape[1:])
    token = int(np.prod(shape[2:], dtype=np.int64)) * itemsize
    return (1, max(1, min(shape[1], CHUNK_BYTES // max(token, 1))), *shape[2:])


def _decode(
    bits: np.ndarray, scale: np.ndarray | None, hidden_as: str, hidden_size: int, what: str
) -> np.ndarray:
    """Store bits -> floats of `hidden_as` (fp8 bits or nvfp4 rows with their scales: FORMAT.md's
    decodes); `what` names the block in an error."""
    if scale is not None:
        stored, scale_t = torch.from_numpy(bits), torch.from_numpy(scale)
        values = decode_scaled_hidden(stored, scale_t, hidden_size, torch.float32)
    else:
        values = bits_to_bf16(bits).float()
    return _as_floats(values, hidden_as, what)


def _as_floats(values: torch.Tensor, hidden_as: str, what: str) -> np.ndarray:
    """`values` as `hidden_as`; ValueError when float16 would turn finite values into inf
    (bf16 and scaled fp8 reach far past its 65504: a file of infs, silently, otherwise)."""
    out = values.to(getattr(torch, hidden_as))
    if hidden_as == "float16" and (overflow := out.isinf() & values.isfinite()).any():
        largest = float(values[overflow].abs().max())
        raise ValueError(
            f"--hidden-as float16: {what} holds {int(overflow.sum())} values beyond float16's "
            f"range (+-65504; the largest {largest:.4g}); export with --hidden-as float32, or "
            "bits"
        )
    return out.numpy()


def _encoding(name: str, info: StoreInfo, hidden_as: str) -> str:
    scaled = name == "hidden" and info.hidden_dtype != "bfloat16"
    if hidden_as != "bits":
        source = f"{info.hidden_dtype} and hidden_scale" if scaled else "bf16"
        return f"{hidden_as} (decoded from {source})"
    if not scaled:
        return "bfloat16-bits"
    return "nvfp4-rows" if info.hidden_dtype == "nvfp4" else "float8_e4m3fn-bits"


def _shard_meta(info: StoreInfo, index: int) -> dict[str, Any]:
    meta = json.loads((shards_dir(info.path) / shard_name(index) / "zarr.json").read_text())
    return meta["attributes"][SHARD_ATTR]


def _write_head(f: h5py.File, info: StoreInfo, hidden_as: str, filters: dict[str, Any]) -> None:
    """target_head.safetensors as the group /target_head (same tensor names)."""
    group = f.create_group(HEAD)
    with safe_open(str(info.path / HEAD_FILE), framework="pt") as head:
        group.attrs["metadata"] = json.dumps(head.metadata() or {})
        for key in head.keys():  # noqa: SIM118 (safe_open is not iterable)
            tensor = head.get_tensor(key)
            if hidden_as == "bits":
                data = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
            else:
                data = _as_floats(tensor.float(), hidden_as, f"{HEAD}/{key}")
            ds = group.create_dataset(
                key, data=data, chunks=_chunks(data.shape, data.itemsize), **filters
            )
            ds.attrs["encoding"] = "bfloat16-bits" if hidden_as == "bits" else hidden_as


def store_to_hdf5(
    store: str | Path,
    out: str | Path,
    *,
    shards: str | None = None,
    arrays: str | None = None,
    compression: str = "gzip",
    hidden_as: str = "bits",
    overwrite: bool = False,
) -> Path:
    """Write the selected shards and arrays of `store` to the HDF5 file `out`; returns `out`.
    An existing `out` is replaced only with `overwrite` (as extract and generate treat --out)."""
    info = open_store(store)
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a folder; pass the HDF5 file to write, e.g. {out / 'store.h5'}")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists; pass --overwrite to replace it, or choose another file")
    if compression not in COMPRESSIONS or hidden_as not in HIDDEN_AS:
        raise ValueError(f"--compression must be one of {COMPRESSIONS}, --hidden-as of {HIDDEN_AS}")
    selected = parse_shards(shards, committed_shards(info.path), info.path)
    if not selected:
        raise ValueError(f"store {info.path} has no committed shard; run `dflash extract` first")
    if not info.complete:  # e.g. converted while extract runs: say the file is partial
        get_logger().warning(
            "store %s is not complete (%d of %d shards committed): exporting committed shards",
            info.path,
            len(committed_shards(info.path)),
            info.num_shards,
        )
    names = parse_arrays(arrays, info)
    # zarr reads a missing chunk file as zeros: refuse a damaged or foreign shard (files and
    # metadata of the arrays written, every such shard in one error) rather than export zeros
    check_shards(info, [n for n in names if n != HEAD], selected)
    metas = [_shard_meta(info, i) for i in selected]
    seq_off = np.cumsum([0] + [m["num_sequences"] for m in metas]).astype(np.int64)
    doc_off = np.cumsum([0] + [m["num_documents"] for m in metas]).astype(np.int64)
    if out.parent.exists() and not out.parent.is_dir():  # it said the file did not exist
        raise ValueError(f"{out}: {out.parent} is a file, not a folder; choose another path")
    if not out.parent.is_dir():
        raise ValueError(f"{out}: folder {out.parent} does not exist; create it or choose another")
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    filters = _filters(compression)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"], f.attrs["layout_version"] = HDF5_FORMAT, LAYOUT_VERSION
            f.attrs["source_store"] = str(info.path.resolve())
            f.attrs["dflash"] = json.dumps(info.attrs)
            for key in PLAIN_ATTRS:
                f.attrs[key] = info.attrs[key]
            index = f.create_group("index")
            index["shards"] = np.asarray(selected, np.int64)
            index["sequence_offsets"], index["document_offsets"] = seq_off, doc_off
            shard_attrs = [json.dumps(m) for m in metas]
            index.create_dataset("shard_attrs", data=shard_attrs, dtype=h5py.string_dtype())
            first = zarr.open_group(shards_dir(info.path) / shard_name(selected[0]), mode="r")
            datasets = {}
            for name in (n for n in names if n != HEAD):
                if hidden_as != "bits" and name == "hidden_scale":
                    continue  # decoded hidden states already carry their scales
                total = doc_off[-1] if name in DOCUMENT_ARRAYS else seq_off[-1]
                dtype = first[name].dtype
                if hidden_as != "bits" and name in BITS_ARRAYS:
                    dtype = np.dtype(hidden_as)
                shape = (int(total), *first[name].shape[1:])
                if hidden_as != "bits" and name == "hidden":  # decoded: hidden_size values
                    shape = (*shape[:-1], info.hidden_size)
                chunks = _chunks(shape, dtype.itemsize)
                ds = f.create_dataset(
                    name, shape=shape, dtype=dtype, chunks=chunks, **(filters if chunks else {})
                )
                if name in BITS_ARRAYS:
                    ds.attrs["encoding"] = _encoding(name, info, hidden_as)
                datasets[name] = ds
            with tqdm(total=int(seq_off[-1]), desc="to hdf5", unit="seq", disable=None) as bar:
                for pos, shard in enumerate(selected):
                    _copy_shard(info, shard, datasets, seq_off[pos], doc_off[pos], hidden_as)
                    bar.update(metas[pos]["num_sequences"])
            if HEAD in names:
                _write_head(f, info, hidden_as, filters)
        os.replace(tmp, out)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if (code := _h5_errno(err)) in NO_SPACE_ERRNOS:
            # about the store's size of these shards (the file compresses like the store)
            needed = sum(sum(m.get(FILES_KEY, {}).values()) for m in metas)
            fix = "free space (or raise the limit), or pick fewer --shards/--arrays; then rerun"
            with space_checked("the HDF5 file", out, needed, fix):
                raise OSError(code, str(err)) from err
        raise
    return out


def _h5_errno(err: BaseException) -> int | None:
    """The errno of a failed HDF5 write: h5py raises it as a RuntimeError or OSError whose
    text holds `errno = N` (its errno attribute is not set)."""
    found = re.search(r"errno = (\d+)", str(err))
    return int(found.group(1)) if found else None


def _copy_shard(
    info: StoreInfo,
    shard: int,
    datasets: dict[str, h5py.Dataset],
    seq0: int,
    doc0: int,
    hidden_as: str,
) -> None:
    """One shard's arrays into rows [seq0, ...) (documents: [doc0, ...)) of the datasets."""
    group = zarr.open_group(shards_dir(info.path) / shard_name(shard), mode="r")

    def read(name: str, where: Any) -> np.ndarray:
        """A block of the store; StoreError naming shard and array when its bytes do not
        decode (a flipped byte: zarr raises checksum and codec errors of many types). Only
        reads are wrapped: an error writing OUT (disk full) keeps its own message."""
        try:
            return np.asarray(group[name][where])
        except Exception as err:
            raise StoreError(
                f"store {info.path}: {shard_name(shard)} array {name} cannot be decoded "
                f"({type(err).__name__}: {err}); {REEXTRACT}"
            ) from err

    for name, ds in datasets.items():
        array = group[name]
        if name in DOCUMENT_ARRAYS:
            ds[doc0 : doc0 + array.shape[0]] = read(name, np.s_[...])
            continue
        n, S = array.shape[:2]
        # decoded: up to fp32 a value (an nvfp4 row of W bytes holds 16 W / 9 values)
        per_value = 8 if name == "hidden" and info.hidden_dtype == "nvfp4" else 4
        token_bytes = int(np.prod(array.shape[2:], dtype=np.int64)) * per_value
        # whole sequences per block, or spans of tokens when one sequence is too big (logits)
        rows = max(1, BLOCK_BYTES // (S * token_bytes))
        toks = S if rows > 1 else max(1, min(S, BLOCK_BYTES // token_bytes))
        for r in range(0, n, rows):
            for t in range(0, S, toks):
                where = np.s_[r : r + rows, t : t + toks]
                block = read(name, where)
                if hidden_as != "bits" and name in BITS_ARRAYS:
                    scaled = name == "hidden" and info.hidden_dtype != "bfloat16"
                    scale = read("hidden_scale", where) if scaled else None
                    what = f"{shard_name(shard)} array {name}"
                    block = _decode(block, scale, hidden_as, info.hidden_size, what)
                ds[seq0 + r : seq0 + r + block.shape[0], t : t + block.shape[1]] = block
