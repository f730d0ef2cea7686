"""The store contract shared by `extract` (writer), `train` and `inspect` (readers).

FORMAT.md is the human description of this layout; this module is its code. A store is a
folder holding a Zarr v3 group: provenance in the root group's attributes under "dflash",
the target's frozen embedding / final norm / LM head in `target_head.safetensors`, and one
Zarr v3 group per committed shard under `shards/`. A shard becomes visible only by an atomic
rename of its finished temporary folder, so a reader never sees half a shard.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.fp4 import (
    BLOCK,
    compiled_encoder,
    compiled_quantize_nvfp4,
    dequantize_nvfp4,
    nvfp4_row_bytes,
    quantize_nvfp4,
    rows_dynamic,
)
from common.generated import META_DIR as GENERATE_META_DIR
from common.generated import read_manifest

FORMAT_NAME = "dflash-offline-store"
FORMAT_VERSION = 2
# Version 2 added each shard's recorded file sizes (`files`, below); the values are unchanged,
# so version-1 stores are still read (their shards' files unchecked) and resumed.
READABLE_VERSIONS = (1, 2)
ROOT_ATTR = "dflash"
SHARD_ATTR = "dflash_shard"
HEAD_FILE = "target_head.safetensors"
SHARDS_DIR = "shards"
SHARD_RE = re.compile(r"^shard-(\d{6})$")
TMP_PREFIX = ".tmp-"
FILES_KEY = "files"  # under SHARD_ATTR: {path in the shard folder: bytes}, recorded at commit
REEXTRACT = "delete the shard folder and rerun the same `dflash extract` command to rebuild it"

# Per-token arrays of a shard, [num_sequences, seq_len, ...]: name -> (zarr dtype, trailing dims)
# Trailing dims are names resolved from the root attributes.
SEQUENCE_ARRAYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tokens": ("int32", ()),
    "loss_mask": ("uint8", ()),
    "position_ids": ("int32", ()),
    "document_ids": ("int32", ()),
    "hidden": ("uint16", ("num_tapped", "hidden_size")),  # bf16 bits (uint8: below)
    "target_argmax": ("int32", ()),
    "topk_ids": ("int32", ("topk",)),
    "topk_logits": ("float32", ("topk",)),
    "logsumexp": ("float32", ()),
}
OPTIONAL_SEQUENCE_ARRAYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "logits": ("uint16", ("vocab_size",)),  # bf16 bits, only with store_full_logits
}
# What `hidden` holds, by the root attribute `hidden_dtype`: name -> (zarr dtype of `hidden`,
# whether a per-token, per-layer fp32 `hidden_scale` [n, S, K] comes with it)
HIDDEN_DTYPES: dict[str, tuple[str, bool]] = {
    "bfloat16": ("uint16", False),
    "float8_e4m3fn": ("uint8", True),
    "nvfp4": ("uint8", True),
}
# The width of a token's row of one layer in `hidden`, where it is not `hidden_size` values: an
# nvfp4 row is its packed codes and block scales (common/fp4.py, FORMAT.md)
HIDDEN_ROW_WIDTH = {"nvfp4": "nvfp4_row_bytes"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Per-document arrays of a shard, [num_documents]
DOCUMENT_ARRAYS: dict[str, str] = {
    "doc_source_index": "int64",  # row of the input dataset
    "doc_piece": "int32",  # 0, or i for the i-th piece of a split over-long document
    "doc_sequence": "int32",  # sequence (row) of this shard holding the document
    "doc_start": "int32",  # first token of the document within that sequence
    "doc_length": "int32",  # tokens of the document
}
# Root attributes every reader indexes (FORMAT.md), with their JSON type: a store without one
# (an edit by hand, another tool's file) is refused by `open_store`, not met as a KeyError later
REQUIRED_ROOT_ATTRS: dict[str, type] = {
    "target": dict,
    "tokenizer": dict,
    "tapped_layers": list,
    "hidden_size": int,
    "vocab_size": int,
    "seq_len": int,
    "topk": int,
    "full_logits": bool,
    "sequences_per_shard": int,
    "num_shards": int,
    "dataset": dict,
}


class StoreError(ValueError):
    """A store that cannot be read or written as asked; the message names the store and the fix."""


def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


def shards_dir(store: str | Path) -> Path:
    return Path(store) / SHARDS_DIR


def committed_shards(store: str | Path) -> list[int]:
    """Indices of the shards whose atomic rename has happened, sorted."""
    folder = shards_dir(store)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = SHARD_RE.match(entry.name)
        if match and entry.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)


def bf16_to_bits(tensor: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> uint16 numpy array holding the same bits (zarr has no bfloat16)."""
    assert tensor.dtype == torch.bfloat16
    return tensor.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    """uint16 numpy array of bf16 bits -> bf16 tensor (no copy of values, bit-exact)."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def quantize_fp8(hidden_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (uint8 bits of float8_e4m3fn [..., D], fp32 scale [...]), one scale per row
    (= per token and tapped layer): scale = amax(|row|) / 448, so the row's largest value maps
    to the largest finite fp8. Runs on the tensor's device, in fp32."""
    x = hidden_ND.float()
    scale = x.abs().amax(-1) / FP8_MAX
    # A zero row (or one whose amax / 448 underflows) gets scale 1 and decodes to zeros; NaN
    # stays NaN, so a finiteness check of the scales still sees a NaN/Inf row.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # clamp: x / scale may land a rounding step above 448, which some casts turn into NaN
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


@functools.cache
def compiled_quantize_fp8() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_fp8` as one compiled region over [N, D] features, N dynamic (extract's fp8
    encoder where the head is compiled: a CUDA target's default). Eager it is four passes over
    each tapped layer's features (fp32 copy, amax, divide, cast): 0.64 ms a layer at the 8B
    width on an H200, 0.8% of a bare forward for five layers (BENCHMARKS.md, "encode_cost").
    Any leading shape is seen as [N, D]; a single row runs eager (its row count, 1, would get a
    graph of its own), as `compiled_quantize_nvfp4`'s does."""
    compiled = compiled_encoder(quantize_fp8)

    def quantize(hidden_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D, leading = hidden_ND.shape[-1], hidden_ND.shape[:-1]
        if hidden_ND.numel() == D:
            return quantize_fp8(hidden_ND)
        bits_ND, scale_N = compiled(hidden_ND.reshape(-1, D))
        return bits_ND.reshape(hidden_ND.shape), scale_N.reshape(leading)

    return quantize


def dequantize_fp8(
    bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The FORMAT.md decode: float(bits viewed as float8_e4m3fn) * scale, in fp32, then `dtype`."""
    return (bits.view(torch.float8_e4m3fn).float() * scale[..., None].float()).to(dtype)


def hidden_row_width(hidden_dtype: str, hidden_size: int) -> int:
    """Elements of one token's row of one tapped layer in `hidden`: `hidden_size` values (bf16,
    fp8), or an nvfp4 row's bytes."""
    return nvfp4_row_bytes(hidden_size) if hidden_dtype == "nvfp4" else hidden_size


def hidden_bytes_per_token(hidden_dtype: str, num_tapped: int, hidden_size: int) -> int:
    """Uncompressed bytes of one token's `hidden` and `hidden_scale` rows in such a store."""
    width = hidden_row_width(hidden_dtype, hidden_size)
    if HIDDEN_DTYPES[hidden_dtype][1]:  # one byte a value (a row), one fp32 scale a layer
        return num_tapped * (width + 4)
    return num_tapped * hidden_size * 2


def hidden_dtype_problem(
    hidden_dtype: str,
    hidden_size: int,
    option: str = "store.hidden_dtype=",
    set_option: str = "--set store.hidden_dtype=",
) -> str | None:
    """Why features of `hidden_size` cannot be stored as `hidden_dtype`, or None. `option` and
    `set_option`: how the command names the setting and how its user sets it (extract's by
    default; `dflash convert`'s import passes `--hidden-dtype=` and `--hidden-dtype `)."""
    block = BLOCK["nvfp4"]
    if hidden_dtype == "nvfp4" and hidden_size % block:
        return (
            f"{option}nvfp4 stores blocks of {block} features, and the target's hidden size "
            f"{hidden_size} is not a multiple: {set_option}float8_e4m3fn (one byte a feature) "
            "or bfloat16"
        )
    return None


def encode_hidden(
    hidden_ND: torch.Tensor, hidden_dtype: str, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., D] features -> what `hidden` and `hidden_scale` of a `hidden_dtype` store hold for
    them: bf16 values and no scale, or fp8 bits / nvfp4 rows (uint8) and fp32 scales [...].
    Runs on the tensor's device; `compiled`: fp8's and nvfp4's encoders compiled (the same
    bytes on the CPU; `compiled_quantize_fp8`, `compiled_quantize_nvfp4`)."""
    if hidden_dtype == "bfloat16":
        return hidden_ND.to(torch.bfloat16), None
    if hidden_dtype == "float8_e4m3fn":
        return (compiled_quantize_fp8() if compiled else quantize_fp8)(hidden_ND)
    if hidden_dtype == "nvfp4":
        return (compiled_quantize_nvfp4() if compiled else quantize_nvfp4)(hidden_ND)
    raise ValueError(f"hidden_dtype {hidden_dtype!r}: one of {', '.join(HIDDEN_DTYPES)}")


def decode_scaled_hidden(
    stored_KW: torch.Tensor,
    scale_K: torch.Tensor,
    hidden_size: int,
    dtype: torch.dtype,
    compiled: bool = False,
) -> torch.Tensor:
    """Features of a scaled `hidden` (fp8 or nvfp4, told apart by the rows' width: fp8's is
    `hidden_size` bytes, nvfp4's nvfp4_row_bytes(hidden_size)) with their fp32 scales, decoded
    to [..., hidden_size] in `dtype`. A batch of either store decodes here, the dev store's
    beside the training store's, whatever each holds. `compiled`: one compiled graph over the
    rows (`compiled_decode_rows`; training's on a GPU), the same values: eager, nvfp4's decode
    is ~10 passes over every feature of a batch (nibbles, their e2m1 values, two scales), each
    in fp32, where the graph reads 0.56 bytes a feature and writes the result once."""
    width = stored_KW.shape[-1]
    if width not in (hidden_size, nvfp4_row_bytes(hidden_size)):
        raise ValueError(
            f"stored feature rows of {width} bytes are neither fp8 nor nvfp4 rows of hidden "
            f"size {hidden_size}"
        )
    if not compiled or stored_KW.numel() == width:  # one row: its count would get a graph
        return _decode_rows(stored_KW, scale_K, hidden_size, dtype)
    rows_NW, scale_N1 = stored_KW.reshape(-1, width), scale_K.reshape(-1, 1)
    features_ND = compiled_decode_rows()(rows_NW, scale_N1, hidden_size, dtype)
    return features_ND.reshape(*stored_KW.shape[:-1], hidden_size)


def _decode_rows(
    stored_KW: torch.Tensor, scale_K: torch.Tensor, hidden_size: int, dtype: torch.dtype
) -> torch.Tensor:
    if stored_KW.shape[-1] == hidden_size:
        return dequantize_fp8(stored_KW, scale_K, dtype)
    return dequantize_nvfp4(stored_KW, scale_K, dtype)


def _decode_rows_N1(
    rows_NW: torch.Tensor, scale_N1: torch.Tensor, hidden_size: int, dtype: torch.dtype
) -> torch.Tensor:
    # the scales as [N, 1]: rows_dynamic marks the row count of 2-D inputs only
    return _decode_rows(rows_NW, scale_N1[:, 0], hidden_size, dtype)


@functools.cache
def compiled_decode_rows() -> Callable[..., torch.Tensor]:
    """`_decode_rows` compiled over [N, W] rows and [N, 1] scales, N dynamic: one graph per
    store dtype, hidden size and compute dtype, for every batch's token count."""
    return rows_dynamic(torch.compile(_decode_rows_N1, fullgraph=True))


def sequence_array_specs(
    hidden_dtype: str, full_logits: bool
) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The per-token arrays a shard of a store with these root attributes holds."""
    bits, scaled = HIDDEN_DTYPES[hidden_dtype]
    specs = dict(SEQUENCE_ARRAYS)
    specs["hidden"] = (bits, ("num_tapped", HIDDEN_ROW_WIDTH.get(hidden_dtype, "hidden_size")))
    if scaled:
        specs["hidden_scale"] = ("float32", ("num_tapped",))
    return specs | (OPTIONAL_SEQUENCE_ARRAYS if full_logits else {})


@dataclass(frozen=True)
class StoreInfo:
    """The root attributes of a store, checked against what this code understands."""

    path: Path
    attrs: dict[str, Any]

    @property
    def complete(self) -> bool:
        return bool(self.attrs.get("complete", False))

    @property
    def tapped_layers(self) -> list[int]:
        return list(self.attrs["tapped_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.attrs["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.attrs["vocab_size"])

    @property
    def seq_len(self) -> int:
        return int(self.attrs["seq_len"])

    @property
    def topk(self) -> int:
        return int(self.attrs["topk"])

    @property
    def hidden_dtype(self) -> str:
        return str(self.attrs["hidden_dtype"])

    @property
    def num_shards(self) -> int:
        return int(self.attrs["num_shards"])

    def dim(self, name: str) -> int:
        if name == "num_tapped":
            return len(self.tapped_layers)
        if name == "nvfp4_row_bytes":
            return hidden_row_width("nvfp4", self.hidden_size)
        return int(self.attrs[name])


def shard_layout(
    info: StoreInfo, num_sequences: int, num_documents: int
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The FORMAT.md (dtype, shape) of every array of a shard of `info`'s store holding
    `num_sequences` sequences and `num_documents` documents."""
    specs = sequence_array_specs(info.hidden_dtype, bool(info.attrs["full_logits"]))
    layout = {
        name: (dtype, (num_sequences, info.seq_len, *map(info.dim, dims)))
        for name, (dtype, dims) in specs.items()
    }
    return layout | {name: (dtype, (num_documents,)) for name, dtype in DOCUMENT_ARRAYS.items()}


def layout_mismatch(array: Any, dtype: str, shape: tuple[int, ...]) -> str | None:
    """How an opened array (zarr or numpy) differs from its FORMAT.md dtype and shape, or None."""
    if array.dtype != np.dtype(dtype):
        return f"dtype {array.dtype}, expected {dtype}"
    if tuple(array.shape) != shape:
        return f"shape {tuple(array.shape)}, expected {shape}"
    return None


def _generate_finished(folder: Path) -> bool:
    """Whether a `dflash generate` folder's manifest says complete (an unreadable one: as if
    finished, so the message stays the plain one)."""
    try:
        manifest = read_manifest(folder)
    except ValueError:
        return True
    return manifest is None or bool(manifest.get("complete"))


def read_root_attrs(store: str | Path) -> dict[str, Any]:
    """The "dflash" attributes of the root group, read from zarr.json without opening arrays."""
    store = Path(store)
    meta = store / "zarr.json"
    if not store.exists():
        raise StoreError(f"store {store} does not exist; run `dflash extract` to create it")
    if not meta.is_file():
        if (store / GENERATE_META_DIR).is_dir():  # the step before extract: a common slip
            if not _generate_finished(store):  # which extract refuses: finish it first
                raise StoreError(
                    f"{store} is an unfinished `dflash generate` output, not a store: rerun "
                    "the same `dflash generate` command to finish it, then `dflash extract "
                    f"--data {store} --out STORE` on it, and pass STORE"
                )
            raise StoreError(
                f"{store} is a `dflash generate` output, not a store: run `dflash extract "
                f"--data {store} --out STORE` on it, then pass STORE"
            )
        if store.resolve().name == SHARDS_DIR and (store / ".." / "zarr.json").is_file():
            raise StoreError(
                f"{store} is the shards folder of a store, not a store: pass the store "
                f"folder {os.path.normpath(store / '..')} (one level up)"
            )
        raise StoreError(
            f"{store} is not a dflash store (no zarr.json); pass the folder extract wrote"
        )
    try:
        doc = json.loads(meta.read_text())
    except (ValueError, OSError) as err:  # cut by a full disk, or edited by hand
        raise StoreError(
            f"{meta} is unreadable ({err}): the store's root metadata is damaged; delete the "
            f"folder {store} and rerun the same `dflash extract` to write the store again"
        ) from err
    # valid JSON of another shape (an edit by hand, another tool's file) is not a store either
    node = doc.get("attributes") if isinstance(doc, dict) else None
    attrs = node.get(ROOT_ATTR) if isinstance(node, dict) else None
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or not isinstance(attrs, dict):
        shard = isinstance(node, dict) and SHARD_ATTR in node
        if shard and store.resolve().parent.name == SHARDS_DIR:
            # one committed shard (STORE/shards/shard-NNNNNN): a slip of the tab key
            raise StoreError(
                f"{store} is one shard of a store, not a store: pass the store folder "
                f"{os.path.normpath(store / '..' / '..')} (two levels up)"
            )
        raise StoreError(
            f"{store} is a Zarr store but not a dflash store (no '{ROOT_ATTR}' attributes)"
        )
    return attrs


def rounded_dev_features_note(info: StoreInfo, named: str) -> str | None:
    """Why chained tau on this dev store is not quite the drafter's online tau, or None: its
    features are rounded (fp8, nvfp4) where a server feeds the drafter the target's own. On
    bf16 dev stores the offline figure matched the online one to 4 decimals (pystd-28m); the
    default store is nvfp4 since the forty-first session, so a dev store extracted with the
    training store's settings would otherwise be scored on 4-bit features unannounced."""
    if info.hidden_dtype == "bfloat16":
        return None
    return (
        f"{named} {info.path} holds {info.hidden_dtype} features, which a server never feeds "
        "the drafter: its chained tau there is not quite the online tau (bf16 features gave "
        "the online figure to 4 decimals); extract the dev store with --set "
        "store.hidden_dtype=bfloat16 (a dev store is small)"
    )


def open_store(store: str | Path, *, require_complete: bool = False) -> StoreInfo:
    """Validate a store's format and version and return its attributes.

    Rejects other formats and versions, a `hidden_dtype` this code cannot decode, and missing or
    ill-typed root attributes, with a message that says what to do.
    """
    attrs = read_root_attrs(store)
    if attrs.get("format") != FORMAT_NAME:
        raise StoreError(f"{store}: format {attrs.get('format')!r} is not {FORMAT_NAME!r}")
    version = attrs.get("format_version")
    if version not in READABLE_VERSIONS:
        raise StoreError(
            f"{store}: store format version {version} is not supported by this dflash-offline "
            f"(reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-extract it with "
            "this version or use the dflash-offline release that wrote it"
        )
    hidden_dtype = attrs.get("hidden_dtype")
    if hidden_dtype not in HIDDEN_DTYPES:
        raise StoreError(
            f"{store}: hidden_dtype {hidden_dtype!r} is not one this dflash-offline reads "
            f"({', '.join(HIDDEN_DTYPES)}); re-extract the store with --set "
            "store.hidden_dtype=... set to one of them, or use the dflash-offline release that "
            "wrote it"
        )
    wrong = [
        f"{key} {'missing' if key not in attrs else f'is {attrs[key]!r}, not {kind.__name__}'}"
        for key, kind in REQUIRED_ROOT_ATTRS.items()
        if not isinstance(attrs.get(key), kind)
    ]
    if wrong:
        raise StoreError(
            f"{store}: root attributes {'; '.join(wrong)} (FORMAT.md); the store's zarr.json was "
            "edited or written by other code: re-extract it, or use the release that wrote it"
        )
    info = StoreInfo(Path(store), attrs)
    if require_complete and not info.complete:
        done = len(committed_shards(store))
        # a store `dflash convert` imported (FORMAT.md: converted_from) resumes by its command
        writer = "dflash convert" if "converted_from" in attrs else "dflash extract"
        raise StoreError(
            f"{store}: extraction is not finished ({done}/{info.num_shards} shards committed); "
            f"rerun the same `{writer}` command to complete it"
        )
    return info
