"""The HDF5 input layout of `dflash convert IN.h5 STORE`, read and checked before anything is
written (FORMAT.md, "HDF5 files", documents it):

    /tokens          int [N]        every document's token ids, concatenated
    /doc_lengths     int [P]        tokens per document (sum N), or /doc_offsets [P] or [P+1]
    /loss_mask       [N]            optional, 0/1 (default: 1 on every token)
    /hidden          [N, K, D]      float32/float16, or uint16 with attr encoding=bfloat16-bits;
                                    attr tapped_layers = the K decoder layer ids
    /target_argmax   int [N]        optional verifier outputs; /topk_ids [N, k],
    /topk_logits, /logsumexp        /topk_logits [N, k], /logsumexp [N] optional, together
    /doc_source_index int [P]       optional (default 0..P-1)
    /target_head/{embed_tokens.weight, norm.weight, lm_head.weight}   optional with attr target
    root attrs: target (model folder: config, tokenizer, head), or target_config (JSON) with
                /target_head; optional tokenizer, pad_token_id, eos_token_id, mask_token_id,
                rms_norm_eps

Every problem is a ValueError naming the file, the dataset and the fix.

Legend: N tokens, P documents, K tapped layers, D hidden size, k top-k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from common.store import bits_to_bf16

HEAD_TENSORS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
VERIFIER = ("target_argmax", "topk_ids", "topk_logits", "logsumexp")
BF16_BITS = "bfloat16-bits"
LAYOUT_HINT = "see FORMAT.md, 'HDF5 files' for the input layout"


@dataclass
class Hdf5Input:
    """An open input file, checked: its datasets and what they describe."""

    path: Path
    file: h5py.File
    lengths: np.ndarray  # int64 [P]
    starts: np.ndarray  # int64 [P] first token of each document in /tokens
    tapped_layers: list[int]
    hidden_size: int
    verifier: bool  # /target_argmax and /topk_* are in the file
    topk: int  # k of the file's top-k (0 without verifier outputs)
    attrs: dict[str, Any] = field(default_factory=dict)

    def floats(self, name: str, where: Any) -> torch.Tensor:
        """Rows of a float dataset (or of bf16 bits, by its `encoding` attribute) as fp32."""
        ds = self.file[name]
        data = np.asarray(ds[where])
        if ds.attrs.get("encoding") == BF16_BITS:
            return bits_to_bf16(data.astype(np.uint16, copy=False)).float()
        return torch.from_numpy(data.astype(np.float32, copy=False))


def _fail(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: {what}; {LAYOUT_HINT}")


def _document_bounds(f: h5py.File, path: Path, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, starts) from /doc_lengths or /doc_offsets, checked against /tokens."""
    if "doc_lengths" in f:
        lengths = np.asarray(f["doc_lengths"][...], np.int64)
        starts = np.cumsum(lengths) - lengths
    elif "doc_offsets" in f:
        offsets = np.asarray(f["doc_offsets"][...], np.int64)
        if len(offsets) == 0 or offsets[-1] != num_tokens:  # [P] starts: append the end
            offsets = np.append(offsets, num_tokens)
        starts, lengths = offsets[:-1], np.diff(offsets)
        if len(starts) and starts[0] != 0:
            raise _fail(path, f"/doc_offsets starts at {starts[0]}, not 0")
    else:
        raise _fail(
            path,
            "no document boundaries: add /doc_lengths (tokens per document) or /doc_offsets "
            "(the first token of each document in /tokens)",
        )
    if len(lengths) == 0:
        raise _fail(path, "no documents (/doc_lengths or /doc_offsets is empty)")
    if (lengths < 1).any():
        raise _fail(path, f"document {int(np.argmax(lengths < 1))} has no tokens (length < 1)")
    if int(lengths.sum()) != num_tokens:
        raise _fail(
            path,
            f"the document lengths sum to {int(lengths.sum())} but /tokens holds {num_tokens} "
            "tokens; they must describe /tokens exactly",
        )
    return lengths, starts


def open_input(path: str | Path) -> Hdf5Input:
    """Open and check an input file (shapes and presence; values are checked as they are read)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; pass the HDF5 file to import")
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise ValueError(f"{path} is not a readable HDF5 file ({err})") from err
    if f.attrs.get("format") == "dflash-offline-hdf5":
        source = f.attrs.get("source_store")
        f.close()
        raise ValueError(
            f"{path} is an export of the store {source} (`dflash convert STORE OUT.h5`), whose "
            f"packed layout is not the input layout: use that store as it is; {LAYOUT_HINT}"
        )
    for name in ("tokens", "hidden"):
        if name not in f:
            raise _fail(path, f"dataset /{name} is missing")
    num_tokens = f["tokens"].shape[0] if f["tokens"].ndim == 1 else -1
    if num_tokens < 0:
        raise _fail(path, f"/tokens must be 1-D [N], got shape {f['tokens'].shape}")
    lengths, starts = _document_bounds(f, path, num_tokens)
    hidden = f["hidden"]
    layers = hidden.attrs.get("tapped_layers", f.attrs.get("tapped_layers"))
    if layers is None:
        raise _fail(path, "/hidden has no attribute tapped_layers (the K decoder layer ids)")
    layers = [int(i) for i in np.atleast_1d(layers)]
    if hidden.ndim != 3 or hidden.shape[:2] != (num_tokens, len(layers)):
        raise _fail(
            path,
            f"/hidden has shape {hidden.shape}, expected [N={num_tokens}, K={len(layers)}, D] "
            "(one row per token of /tokens, one per tapped layer)",
        )
    expected = {"loss_mask": (num_tokens,), "doc_source_index": (len(lengths),)}
    present = [name for name in VERIFIER if name in f]
    if present and len(present) != len(VERIFIER):
        raise _fail(
            path,
            f"verifier outputs {present} without {sorted(set(VERIFIER) - set(present))}: give "
            "all four (target_argmax, topk_ids, topk_logits, logsumexp) or none",
        )
    topk = f["topk_ids"].shape[-1] if present else 0
    expected |= {name: (num_tokens,) for name in ("target_argmax", "logsumexp")}
    expected |= {name: (num_tokens, topk) for name in ("topk_ids", "topk_logits")}
    for name, shape in expected.items():
        if name in f and f[name].shape != shape:
            raise _fail(
                path, f"/{name} has shape {f[name].shape}, expected {list(shape)} (as /tokens)"
            )
    for name in ("hidden", *(("topk_logits", "logsumexp") if present else ())):
        _check_floats(path, f[name], name)
    return Hdf5Input(
        path=path,
        file=f,
        lengths=lengths,
        starts=starts,
        tapped_layers=layers,
        hidden_size=int(hidden.shape[2]),
        verifier=bool(present),
        topk=int(topk),
        attrs={k: _plain(v) for k, v in f.attrs.items()},
    )


def _check_floats(path: Path, ds: h5py.Dataset, name: str) -> None:
    """A float dataset is floats, or bf16 bits in 16-bit integers marked as such: integers
    without the mark would be read as numbers (bf16 pattern 16065 as 16065.0) and train on
    garbage that no later check can tell from features."""
    encoding = _plain(ds.attrs.get("encoding"))
    if ds.dtype.kind == "f" and encoding is None:
        return
    if ds.dtype in (np.uint16, np.int16) and encoding == BF16_BITS:
        return
    marked = f" with encoding={encoding!r}" if encoding is not None else ""
    raise _fail(
        path,
        f"/{name} is {ds.dtype}{marked}: give float32/float16, or bf16 bits as uint16 with the "
        f"attribute encoding={BF16_BITS!r}",
    )


def _plain(value: Any) -> Any:
    """An HDF5 attribute as a JSON-ready Python value."""
    if isinstance(value, bytes):
        return value.decode()
    return value.tolist() if isinstance(value, np.ndarray | np.generic) else value


def head_tensors(inp: Hdf5Input) -> dict[str, torch.Tensor] | None:
    """/target_head as bf16 tensors (FORMAT.md's target_head.safetensors), or None if absent."""
    if "target_head" not in inp.file:
        return None
    group = inp.file["target_head"]
    if missing := [name for name in HEAD_TENSORS if name not in group]:
        raise _fail(inp.path, f"/target_head lacks {missing}")
    for name in group:
        _check_floats(inp.path, group[name], f"target_head/{name}")
    return {name: inp.floats(f"target_head/{name}", ()).to(torch.bfloat16) for name in group}


def target_config(inp: Hdf5Input) -> dict[str, Any] | None:
    """The root attribute target_config (the target's transformers config as JSON), or None."""
    text = inp.attrs.get("target_config")
    if text is None:
        return None
    try:
        return dict(json.loads(text))
    except (ValueError, TypeError) as err:
        raise _fail(inp.path, f"attribute target_config is not a JSON object ({err})") from err
