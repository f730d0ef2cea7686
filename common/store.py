"""The store contract shared by `extract` (writer), `train` and `inspect` (readers).

FORMAT.md is the human description of this layout; this module is its code. A store is a
folder holding a Zarr v3 group: provenance in the root group's attributes under "dflash",
the target's frozen embedding / final norm / LM head in `target_head.safetensors`, and one
Zarr v3 group per committed shard under `shards/`. A shard becomes visible only by an atomic
rename of its finished temporary folder, so a reader never sees half a shard.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_NAME = "dflash-offline-store"
FORMAT_VERSION = 1
ROOT_ATTR = "dflash"
SHARD_ATTR = "dflash_shard"
HEAD_FILE = "target_head.safetensors"
SHARDS_DIR = "shards"
SHARD_RE = re.compile(r"^shard-(\d{6})$")
TMP_PREFIX = ".tmp-"

# Per-token arrays of a shard, [num_sequences, seq_len, ...]: name -> (zarr dtype, trailing dims)
# Trailing dims are names resolved from the root attributes.
SEQUENCE_ARRAYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tokens": ("int32", ()),
    "loss_mask": ("uint8", ()),
    "position_ids": ("int32", ()),
    "document_ids": ("int32", ()),
    "hidden": ("uint16", ("num_tapped", "hidden_size")),  # bf16 bits
    "target_argmax": ("int32", ()),
    "topk_ids": ("int32", ("topk",)),
    "topk_logits": ("float32", ("topk",)),
    "logsumexp": ("float32", ()),
}
OPTIONAL_SEQUENCE_ARRAYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "logits": ("uint16", ("vocab_size",)),  # bf16 bits, only with store_full_logits
}
# Per-document arrays of a shard, [num_documents]
DOCUMENT_ARRAYS: dict[str, str] = {
    "doc_source_index": "int64",  # row of the input dataset
    "doc_piece": "int32",  # 0, or i for the i-th piece of a split over-long document
    "doc_sequence": "int32",  # sequence (row) of this shard holding the document
    "doc_start": "int32",  # first token of the document within that sequence
    "doc_length": "int32",  # tokens of the document
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
    def num_shards(self) -> int:
        return int(self.attrs["num_shards"])

    def dim(self, name: str) -> int:
        if name == "num_tapped":
            return len(self.tapped_layers)
        return int(self.attrs[name])


def read_root_attrs(store: str | Path) -> dict[str, Any]:
    """The "dflash" attributes of the root group, read from zarr.json without opening arrays."""
    store = Path(store)
    meta = store / "zarr.json"
    if not store.exists():
        raise StoreError(f"store {store} does not exist; run `dflash extract` to create it")
    if not meta.is_file():
        raise StoreError(
            f"{store} is not a dflash store (no zarr.json); pass the folder extract wrote"
        )
    doc = json.loads(meta.read_text())
    attrs = doc.get("attributes", {}).get(ROOT_ATTR)
    if doc.get("zarr_format") != 3 or attrs is None:
        raise StoreError(
            f"{store} is a Zarr store but not a dflash store (no '{ROOT_ATTR}' attributes)"
        )
    return attrs


def open_store(store: str | Path, *, require_complete: bool = False) -> StoreInfo:
    """Validate a store's format and version and return its attributes.

    Rejects other formats and versions with a message that says what to do.
    """
    attrs = read_root_attrs(store)
    if attrs.get("format") != FORMAT_NAME:
        raise StoreError(f"{store}: format {attrs.get('format')!r} is not {FORMAT_NAME!r}")
    version = attrs.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{store}: store format version {version} is not supported by this dflash-offline "
            f"(reads version {FORMAT_VERSION}); re-extract it with this version or use the "
            "dflash-offline release that wrote it"
        )
    info = StoreInfo(Path(store), attrs)
    if require_complete and not info.complete:
        done = len(committed_shards(store))
        raise StoreError(
            f"{store}: extraction is not finished ({done}/{info.num_shards} shards committed); "
            "rerun the same `dflash extract` command to complete it"
        )
    return info
