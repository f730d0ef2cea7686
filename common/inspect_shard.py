"""Checks of one committed shard for `dflash inspect verify` (common/inspect_verify.py).

A shard is read in blocks of sequences of at most `chunk_bytes` (and bf16/fp8-bits arrays too
big for one sequence, such as full logits, in blocks of tokens), so memory stays constant
whatever the shard size. Bad values are counted across blocks and reported once per kind, with
the first place they occur. Bytes that no longer decode (a truncated or overwritten chunk, broken
array metadata) are reported on their shard and array, and the other shards are still checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr
from tqdm import tqdm

from common.fp4 import nvfp4_codes_bytes
from common.inspect_damage import REEXTRACT, Undecodable, missing_bytes, read_array
from common.store import (
    DOCUMENT_ARRAYS,
    FILES_KEY,
    SHARD_ATTR,
    StoreInfo,
    layout_mismatch,
    sequence_array_specs,
    shard_layout,
    shard_name,
    shards_dir,
)
from common.store_files import file_problems

CHUNK_BYTES = 64 << 20  # bytes read at once per block; bounds memory on stores of any size
SHARD_KEYS = ("index", "num_sequences", "num_documents", "num_tokens", "num_loss_tokens")
BF16_EXPONENT = 0x7F80  # a bf16 is NaN or Inf exactly when all 8 exponent bits are set
SIGN_BIT = 0x80  # of a float8_e4m3fn byte (an nvfp4 row's block scale)
BITS_ARRAYS = ("hidden", "logits")  # big arrays of float bits, streamed in slabs


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a store: where (shard or "store", array) and what."""

    shard: str
    array: str
    problem: str


class _Tally:
    """Bad values of one shard, counted across blocks, each kind with the first place seen."""

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self.found: dict[tuple[str, str], list[Any]] = {}
        self.notes: list[Problem] = []

    def note(self, array: str, what: str) -> None:
        self.notes.append(Problem(self.shard, array, what))

    def add(self, array: str, what: str, bad: np.ndarray, row0: int = 0, tok0: int = 0) -> None:
        count = int(bad.sum())
        if count:
            entry = self.found.setdefault((array, what), [0, None])
            if entry[1] is None:
                where = np.argwhere(bad)[0]
                entry[1] = (
                    f"sequence {row0 + where[0]}, token {tok0 + where[1]}"
                    if bad.ndim >= 2
                    else f"document {row0 + where[0]}"
                )
            entry[0] += count

    def problems(self) -> list[Problem]:
        return self.notes + [
            Problem(self.shard, array, f"{count} {what} (first at {first})")
            for (array, what), (count, first) in self.found.items()
        ]


def _members(group: zarr.Group, info: StoreInfo, tally: _Tally) -> tuple[dict[str, Any], set[str]]:
    """The FORMAT.md arrays present in the shard, and the names whose metadata does not parse
    (reported here, so that `_open_arrays` does not call them missing too)."""
    found, unreadable = {}, set()
    # full_logits=True: a logits array the root attributes do not announce is reported too
    for name in [*sequence_array_specs(info.hidden_dtype, True), *DOCUMENT_ARRAYS]:
        try:
            found[name] = group[name]
        except KeyError:
            continue  # absent: `_open_arrays` reports it where FORMAT.md requires it
        except Exception as err:  # zarr raises many types for damaged metadata
            tally.note(name, f"metadata unreadable ({type(err).__name__}: {err}); {REEXTRACT}")
            unreadable.add(name)
    return found, unreadable


def _open_arrays(
    members: dict[str, Any],
    unreadable: set[str],
    info: StoreInfo,
    n: int,
    num_docs: int,
    tally: _Tally,
) -> dict[str, zarr.Array]:
    """The arrays present with the FORMAT.md dtype and shape; reports the others."""
    found: dict[str, zarr.Array] = {}
    for name, expected in shard_layout(info, n, num_docs).items():
        if name in unreadable:
            continue
        if name not in members:
            tally.note(name, "array missing")
        elif not isinstance(array := members[name], zarr.Array):
            tally.note(name, "is a group, not an array")
        elif what := layout_mismatch(array, *expected):
            tally.note(name, what)
        else:
            found[name] = array
    if not info.attrs["full_logits"] and "logits" in members:
        tally.note("logits", "stored but the root attrs say full_logits is false")
    return found


def _check_documents(docs: dict[str, np.ndarray], n: int, seq_len: int, tally: _Tally) -> bool:
    """Document arrays within bounds, in packing order, not overlapping; False if not."""
    seq, start, length = docs["doc_sequence"], docs["doc_start"], docs["doc_length"]
    before = len(tally.found)
    tally.add("doc_length", "documents shorter than 1 token", length < 1)
    tally.add(
        "doc_start", "documents outside the sequence", (start < 0) | (start + length > seq_len)
    )
    tally.add("doc_sequence", "documents in no sequence of this shard", (seq < 0) | (seq >= n))
    tally.add("doc_source_index", "negative source rows", docs["doc_source_index"] < 0)
    tally.add("doc_piece", "negative piece numbers", docs["doc_piece"] < 0)
    same = seq[1:] == seq[:-1]
    tally.add("doc_sequence", "documents out of packing order", seq[1:] < seq[:-1], 1)
    tally.add(
        "doc_start", "overlapping documents", same & (start[1:] < start[:-1] + length[:-1]), 1
    )
    return len(tally.found) == before


def _expected_layout(
    docs: dict[str, np.ndarray], r0: int, r1: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """document_ids and position_ids of sequences [r0, r1) as the document arrays describe them."""
    doc_ids = np.full((r1 - r0, seq_len), -1, np.int32)
    positions = np.zeros((r1 - r0, seq_len), np.int32)
    lo, hi = np.searchsorted(docs["doc_sequence"], [r0, r1])
    for d in range(lo, hi):
        row, start, length = (
            docs["doc_sequence"][d] - r0,
            docs["doc_start"][d],
            docs["doc_length"][d],
        )
        doc_ids[row, start : start + length] = d
        positions[row, start : start + length] = np.arange(length)
    return doc_ids, positions


def _check_block(b: dict[str, np.ndarray], info: StoreInfo, tally: _Tally, r0: int) -> None:
    """Value checks of the small per-token arrays of one block of sequences."""
    real = b["document_ids"] >= 0 if "document_ids" in b else None
    if "loss_mask" in b:
        tally.add("loss_mask", "values other than 0/1", b["loss_mask"] > 1, r0)
        if real is not None:
            tally.add("loss_mask", "loss tokens on padding", (b["loss_mask"] != 0) & ~real, r0)
    tok = info.attrs["tokenizer"]
    if "tokens" in b and real is not None:
        outside = (b["tokens"] < 0) | (b["tokens"] >= tok.get("vocab_size", info.vocab_size))
        tally.add("tokens", "token ids outside the tokenizer's vocabulary", outside & real, r0)
        if tok.get("pad_token_id") is not None:
            pad = ~real & (b["tokens"] != tok["pad_token_id"])
            tally.add("tokens", "padding tokens that are not the pad id", pad, r0)
    for name in ("topk_logits", "logsumexp"):
        if name in b:
            tally.add(name, "NaN/Inf values", ~np.isfinite(b[name]), r0)
    if "hidden_scale" in b:  # [n, S, K]: every token's scales, padding included (1.0 there)
        scale = b["hidden_scale"]
        tally.add("hidden_scale", "NaN/Inf values", (~np.isfinite(scale)).any(-1), r0)
        tally.add("hidden_scale", "zero or negative scales", (scale <= 0).any(-1), r0)
    if real is None:
        return
    ids, logits = b.get("topk_ids"), b.get("topk_logits")
    if ids is not None:
        tally.add(
            "topk_ids",
            "ids outside the vocabulary",
            ((ids < 0) | (ids >= info.vocab_size)) & real[..., None],
            r0,
        )
    if logits is not None:
        unsorted = (logits[..., :-1] < logits[..., 1:]).any(-1) & real
        tally.add("topk_logits", "tokens whose top-k is not sorted descending", unsorted, r0)
    if ids is not None and "target_argmax" in b:
        hit = ids == b["target_argmax"][..., None]
        # Equal logits may be ordered either way by topk: an argmax tied with the top logit is fine.
        tied = (hit & (logits == logits[..., :1])).any(-1) if logits is not None else hit[..., 0]
        tally.add("target_argmax", "tokens whose argmax is not topk_ids[..., 0]", ~tied & real, r0)
    if logits is not None and "logsumexp" in b:
        top = logits[..., 0]
        low = b["logsumexp"] < top - 1e-3 * np.maximum(1.0, np.abs(top))
        tally.add("logsumexp", "tokens whose log-sum-exp is below the top logit", low & real, r0)


def _check_bits(
    name: str,
    array: zarr.Array,
    real: np.ndarray | None,
    r0: int,
    r1: int,
    tally: _Tally,
    chunk_bytes: int,
    encoding: str = "bfloat16",
) -> None:
    """NaN/Inf in an array of bf16 bits (or, as `hidden` of an fp8 or nvfp4 store, of fp8 bits /
    nvfp4 rows, whose block scales must not be negative either) over sequences [r0, r1), read in
    slabs of <= chunk_bytes (counted decoded, for one-byte encodings)."""
    seq_len = array.shape[1]
    scaled = encoding != "bfloat16"
    per_token = math.prod(array.shape[2:]) * (4 if scaled else array.dtype.itemsize)
    rows = max(1, chunk_bytes // (seq_len * per_token))
    toks = seq_len if rows > 1 else max(1, min(seq_len, chunk_bytes // per_token))
    for a in range(r0, r1, rows):
        for t in range(0, seq_len, toks):
            bits = read_array(array, np.s_[a : min(a + rows, r1), t : t + toks])
            if scaled:  # decoded without the scale: a bad scale is hidden_scale's own problem
                # an nvfp4 row's codes are all finite values: only its block scales can be NaN
                fp8_bits = (
                    bits[..., nvfp4_codes_bytes(bits.shape[-1]) :] if encoding == "nvfp4" else bits
                )
                bad = torch.from_numpy(fp8_bits).view(torch.float8_e4m3fn).float().isnan().numpy()
                if encoding == "nvfp4":
                    # a block scale is amax / 6 / scale, never negative (nor -0.0): one with its
                    # sign bit set flips its block's 16 values, which decode as finite as ever
                    signed = (fp8_bits & SIGN_BIT).astype(bool) & ~bad
                    what = "negative block scales (sign bit set; the encoder writes none)"
                    tally.add(name, what, signed.reshape(*signed.shape[:2], -1).any(-1), a, t)
            else:
                bad = (bits & BF16_EXPONENT) == BF16_EXPONENT
            tally.add(name, "NaN/Inf values", bad.reshape(*bad.shape[:2], -1).any(-1), a, t)
            if name == "hidden" and real is not None:
                pad = ~real[a - r0 : a - r0 + bits.shape[0], t : t + toks]
                nonzero = bits.reshape(*bits.shape[:2], -1).any(-1) & pad
                tally.add(name, "padding tokens with non-zero values", nonzero, a, t)


def _check_files(
    info: StoreInfo, name: str, arrays: dict[str, zarr.Array], attrs: dict[str, Any], tally: _Tally
) -> list[tuple[str, str]]:
    """Every FORMAT.md array's data files against the sizes recorded at commit (format v2): a
    missing one is noted (zarr reads it as zeros); those of another size are returned. Shards
    without a record (v1) get the weaker check of an empty or absent data file."""
    folder = shards_dir(info.path) / name
    recorded = attrs.get(FILES_KEY)
    if recorded is None and info.attrs["format_version"] >= 2:
        tally.note("attrs", f"no recorded file sizes ('{FILES_KEY}'); {REEXTRACT}")
    resized = []
    for array in arrays:
        if missing := missing_bytes(folder / array, array):
            tally.note(array, f"{missing} (it would read as zeros); {REEXTRACT}")
            continue
        own = {rel: size for rel, size in (recorded or {}).items() if rel.split("/")[0] == array}
        for _, what, gone in file_problems(folder, own):
            if gone:
                tally.note(array, f"{what}; {REEXTRACT}")
            else:
                resized.append((array, what))
    return resized


def check_shard(
    info: StoreInfo, index: int, bar: tqdm, chunk_bytes: int = CHUNK_BYTES
) -> tuple[list[Problem], dict[str, int] | None]:
    """Problems of one committed shard, and its counts measured from the arrays (None if unknown)."""
    name = shard_name(index)
    try:
        group = zarr.open_group(str(shards_dir(info.path) / name), mode="r")
    except Exception as err:  # zarr raises many types for damaged metadata; all mean unreadable
        what = f"group unreadable ({type(err).__name__}: {err}); {REEXTRACT}"
        return [Problem(name, "-", what)], None
    attrs = group.attrs.get(SHARD_ATTR, {})
    if missing := [k for k in SHARD_KEYS if k not in attrs]:
        return [
            Problem(name, "attrs", f"missing shard attributes {missing} under {SHARD_ATTR!r}")
        ], None
    tally, start = _Tally(name), bar.n
    try:
        return _check_arrays(info, index, group, attrs, tally, bar, chunk_bytes)
    except Undecodable as err:
        # The shard must be re-extracted anyway: stop reading it, keep what was found so far.
        bar.update(start + 1 - bar.n)
        cause = f"{type(err.err).__name__}: {err.err}"
        return [
            *tally.problems(),
            Problem(name, err.array, f"cannot decode ({cause}); {REEXTRACT}"),
        ], None


def _check_arrays(
    info: StoreInfo,
    index: int,
    group: zarr.Group,
    attrs: dict[str, Any],
    tally: _Tally,
    bar: tqdm,
    chunk_bytes: int,
) -> tuple[list[Problem], dict[str, int] | None]:
    """`check_shard` past the shard attributes: every array's metadata, then its values."""
    name = tally.shard
    members, unreadable = _members(group, info, tally)
    # The arrays are the truth; attributes that disagree with them are reported, not trusted.
    # (a member that is a group, not an array, is reported by the metadata checks below)
    tokens, doc_start = members.get("tokens"), members.get("doc_start")
    n = tokens.shape[0] if isinstance(tokens, zarr.Array) else attrs["num_sequences"]
    num_docs = doc_start.shape[0] if isinstance(doc_start, zarr.Array) else attrs["num_documents"]
    per_shard, last = int(info.attrs["sequences_per_shard"]), index == info.num_shards - 1
    if attrs["index"] != index:
        tally.note("attrs", f"index is {attrs['index']}, expected {index}")
    if not (0 < n <= per_shard if last else n == per_shard):
        what = f"holds {n} sequences; the plan puts {per_shard} in every shard but the last"
        tally.note("tokens", what)
    arrays = _open_arrays(members, unreadable, info, n, num_docs, tally)
    resized = _check_files(info, name, arrays, attrs, tally)
    docs = {k: read_array(arrays[k], np.s_[:]) for k in DOCUMENT_ARRAYS if k in arrays}
    layout = len(docs) == len(DOCUMENT_ARRAYS) and _check_documents(docs, n, info.seq_len, tally)
    small = [k for k in arrays if k not in DOCUMENT_ARRAYS and k not in BITS_ARRAYS]
    per_seq = sum(arrays[k].nbytes // max(n, 1) for k in small) or 1
    step = max(1, chunk_bytes // per_seq)
    counted = {"tokens": 0, "loss_tokens": 0}
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        block = {k: read_array(arrays[k], np.s_[r0:r1]) for k in small}
        if layout and "document_ids" in block:
            doc_ids, positions = _expected_layout(docs, r0, r1, info.seq_len)
            what = "tokens whose document id disagrees with doc_sequence/doc_start/doc_length"
            tally.add("document_ids", what, block["document_ids"] != doc_ids, r0)
            if "position_ids" in block:
                what = "positions not counting from 0 at their document start (or not 0 on padding)"
                tally.add("position_ids", what, block["position_ids"] != positions, r0)
        _check_block(block, info, tally, r0)
        real = block["document_ids"] >= 0 if "document_ids" in block else None
        counted["tokens"] += int(real.sum()) if real is not None else 0
        counted["loss_tokens"] += int(block["loss_mask"].sum()) if "loss_mask" in block else 0
        for big in BITS_ARRAYS:
            if big in arrays:
                encoding = info.hidden_dtype if big == "hidden" else "bfloat16"
                _check_bits(big, arrays[big], real, r0, r1, tally, chunk_bytes, encoding)
        bar.update((r1 - r0) / n)
    problems = tally.problems()
    # a size that differs from the commit's, on an array whose values look right otherwise:
    # rewritten since (train refuses the store until it is re-extracted)
    flagged = {p.array for p in problems}
    problems += [
        Problem(name, array, f"{what}; {REEXTRACT}")
        for array, what in resized
        if array not in flagged
    ]
    measured = {
        "num_tokens": ("document_ids", "tokens"),
        "num_loss_tokens": ("loss_mask", "loss_tokens"),
    }
    for key, (array, total) in measured.items():
        if array in arrays and attrs[key] != counted[total]:
            problems.append(
                Problem(name, "attrs", f"{key} is {attrs[key]} but {array} holds {counted[total]}")
            )
    for key, value in (("num_sequences", n), ("num_documents", num_docs)):
        if attrs[key] != value:
            problems.append(
                Problem(name, "attrs", f"{key} is {attrs[key]} but the arrays hold {value}")
            )
    if not {"document_ids", "loss_mask"} <= arrays.keys():
        return problems, None
    return problems, {"sequences": n, "documents": num_docs, **counted}
