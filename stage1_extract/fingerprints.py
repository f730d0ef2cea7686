"""Fingerprints of what a store was made from, checked when a run resumes: the tokenized
documents and the target's weights.

The content key (store_root.key_parts) covers settings, paths and the documents' lengths, so
on its own it let a rerun resume a store after the data were edited in place (same lengths)
or the target folder was overwritten with other weights: the new shards would silently mix
with the old. These digests close that gap. They live beside the content key rather than in
it, so stores made before they existed still resume (unchecked, with a log line).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors import safe_open

# weight files that are fingerprinted by their bytes' samples (safetensors) or their size
SAFETENSORS = ".safetensors"
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf")


def documents_sha256(table: pa.Table) -> str:
    """sha256 of every document's token ids and loss mask (the tokenized table's input_ids and
    loss_mask columns), in order, as int32 and uint8 bytes whatever integer type the datasets
    cache holds them in."""
    digest = hashlib.sha256()
    for column, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8)):
        digest.update(column.encode())
        for chunk in table[column].chunks:
            values = chunk.flatten()  # respects the chunk's offset, unlike .values
            numbers = values.to_numpy(zero_copy_only=False)
            digest.update(numbers.astype(dtype, copy=False).tobytes())
    return digest.hexdigest()


def _sample_rows(rows: int) -> list[int]:
    """First, middle and last row: a re-initialised, fine-tuned or merged tensor differs in
    all of them, and reading three rows per tensor costs milliseconds."""
    return sorted({0, rows // 2, max(rows - 1, 0)})


def _safetensors_digest(path: Path, digest: hashlib._Hash) -> None:
    with safe_open(str(path), framework="pt") as f:
        for name in sorted(f.keys()):
            piece = f.get_slice(name)
            shape = piece.get_shape()
            digest.update(f"{name}:{piece.get_dtype()}:{shape}".encode())
            if not shape:  # a scalar: read it whole
                digest.update(_tensor_bytes(f.get_tensor(name)))
                continue
            for row in _sample_rows(shape[0]):
                digest.update(_tensor_bytes(piece[row : row + 1]))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_fingerprint(model: str) -> str | None:
    """sha256 over a local target folder's weight files: each safetensors tensor's name, dtype,
    shape and three sampled rows; other weight formats by file name and size. None for a hub
    id, whose resolved revision (in the content key) already names the weights."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    files = sorted(
        p for p in folder.iterdir() if p.suffix in (SAFETENSORS, *OTHER_WEIGHTS) and p.is_file()
    )
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        if path.suffix == SAFETENSORS:
            _safetensors_digest(path, digest)
        else:
            digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()
