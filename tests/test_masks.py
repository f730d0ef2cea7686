"""The anchor-block mask against a mask built independently with plain loops.

Covers the peer bugs of notes/dflash.md: `<=` anchor leak, cross-block leak when anchors are
closer than the block size, document leak, padding, H = num_heads BlockMasks.

Legend: S context tokens, A anchors, B block size, Q = A*B queries, KV = S + Q keys.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from stage2_train.masks import (
    TILE,
    anchor_block_mask,
    anchor_block_mask_mod,
    context_intervals,
    document_starts,
)


def dense_mask(anchors: list[int], doc_ids: list[int], block_size: int) -> torch.Tensor:
    """Expected [Q, KV] mask from the definition, by loops (no intervals, no mask_mod)."""
    n_ctx, n_q = len(doc_ids), len(anchors) * block_size
    out = torch.zeros(n_q, n_ctx + n_q, dtype=torch.bool)
    for q in range(n_q):
        p = anchors[q // block_size]
        for kv in range(n_ctx + n_q):
            if kv < n_ctx:
                out[q, kv] = p >= 0 and kv < p and doc_ids[kv] == doc_ids[p]
            else:
                out[q, kv] = (kv - n_ctx) // block_size == q // block_size
    return out


def packed(lengths: list[int], pad: int) -> list[int]:
    ids = [d for d, n in enumerate(lengths) for _ in range(n)]
    return ids + [-1] * pad


CASES = {
    # anchors closer than B, at a document start, at the last eligible position of a doc
    "close_and_edges": (packed([20, 15, 9], 4), [0, 1, 2, 5, 18, 20, 21, 33, 35, 42], 4),
    "padding_anchors": (packed([12, 12], 8), [3, 4, 12, 22, -1, -1], 4),
    "block_not_dividing_tile": (packed([150, 90, 30], 6), [7, 8, 9, 100, 149, 150, 151, 260], 10),
    "many_tiles": (
        packed([300, 200, 100], 40),
        sorted(torch.randperm(590, generator=torch.Generator().manual_seed(0))[:20].tolist()),
        16,
    ),
}


def _make(doc_ids: list[int], anchors: list[int], block_size: int):
    doc_S = torch.tensor(doc_ids)
    anchors_A = torch.tensor(anchors)
    lo_A, hi_A = context_intervals(anchors_A, doc_S)
    return lo_A, hi_A, len(doc_ids)


@pytest.mark.parametrize("case", CASES)
def test_mask_mod_equals_dense_definition(case: str) -> None:
    doc_ids, anchors, bsz = CASES[case]
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, bsz)
    n_q = len(anchors) * bsz
    got = create_mask(anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz), 1, 1, n_q, n_ctx + n_q, "cpu")
    assert torch.equal(got[0, 0], dense_mask(anchors, doc_ids, bsz))


def test_known_peer_bugs_are_absent() -> None:
    doc_ids, anchors, bsz = CASES["close_and_edges"]
    mask = dense_mask(anchors, doc_ids, bsz)
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, bsz)
    n_q = len(anchors) * bsz
    got = create_mask(anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz), 1, 1, n_q, n_ctx + n_q, "cpu")
    got = got[0, 0]
    assert torch.equal(got, mask)
    for a, p in enumerate(anchors):
        rows = slice(a * bsz, (a + 1) * bsz)
        assert not got[rows, p].any(), "query sees its own anchor position (<= leak)"
        assert not got[rows, p:n_ctx].any(), "query sees context at or after its anchor"
        other_doc = torch.tensor([d != doc_ids[p] for d in doc_ids])
        assert not got[rows, :n_ctx][:, other_doc].any(), "document leak"
        own = torch.zeros(n_q, dtype=torch.bool)
        own[rows] = True
        assert got[rows, n_ctx:][:, own].all(), "block not bidirectional"
        assert not got[rows, n_ctx:][:, ~own].any(), "cross-block leak"
    # anchor 0 at a document start sees no context at all, only its block
    assert not got[:bsz, :n_ctx].any()


def test_document_starts_and_intervals() -> None:
    doc_S = torch.tensor(packed([3, 4, 2], 2))
    assert document_starts(doc_S).tolist() == [0, 0, 0, 3, 3, 3, 3, 7, 7, 9, 9]
    lo_A, hi_A = context_intervals(torch.tensor([1, 3, 5, -1]), doc_S)
    assert lo_A.tolist() == [0, 3, 3, 0] and hi_A.tolist() == [1, 3, 5, 0]
    assert lo_A.dtype == hi_A.dtype == torch.int32


def _tile_flags(bm, n_q_tiles: int, n_kv_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial and full tile flags [QT, KT] of a BlockMask, from its (num, indices) lists."""
    out = []
    for num, idx in (
        (bm.kv_num_blocks, bm.kv_indices),
        (bm.full_kv_num_blocks, bm.full_kv_indices),
    ):
        flags = torch.zeros(n_q_tiles, n_kv_tiles, dtype=torch.bool)
        for i in range(n_q_tiles):
            flags[i, idx[0, 0, i, : num[0, 0, i]].long()] = True
        out.append(flags)
    return out[0], out[1]


@pytest.mark.parametrize("case", CASES)
def test_direct_block_mask_equals_create_block_mask(case: str) -> None:
    doc_ids, anchors, bsz = CASES[case]
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, bsz)
    n_q = len(anchors) * bsz
    n_kv = n_ctx + n_q
    direct = anchor_block_mask(lo_A, hi_A, n_ctx, bsz)
    ref = create_block_mask(
        anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz), 1, None, n_q, n_kv, "cpu"
    )
    assert direct.kv_num_blocks.shape[:2] == (1, 1), "BlockMask must be built with H=None, B=1"
    assert direct.shape == ref.shape and direct.BLOCK_SIZE == ref.BLOCK_SIZE == (TILE, TILE)
    qt, kt = -(-n_q // TILE), -(-n_kv // TILE)
    d_part, d_full = _tile_flags(direct, qt, kt)
    r_part, r_full = _tile_flags(ref, qt, kt)
    assert torch.equal(d_part, r_part) and torch.equal(d_full, r_full)
    assert torch.equal(direct.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(direct.full_kv_num_blocks, ref.full_kv_num_blocks)

    # What a kernel would compute: full tiles all True, partial tiles through the mask_mod.
    dense = dense_mask(anchors, doc_ids, bsz)
    tile_q = torch.arange(n_q) // TILE
    tile_kv = torch.arange(n_kv) // TILE
    full_tok = d_full[tile_q][:, tile_kv]
    part_tok = d_part[tile_q][:, tile_kv]
    assert torch.equal(full_tok | (part_tok & dense), dense), "a tile is missing or not full"
    assert not (full_tok & ~dense).any(), "a 'full' tile holds masked entries"


def test_full_tiles_exist_on_long_context() -> None:
    # 16 anchors deep in one 600-token document: context tiles 0..2 are full for all queries.
    doc_ids = packed([600], 0)
    anchors = list(range(500, 516))
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, 16)
    bm = anchor_block_mask(lo_A, hi_A, n_ctx, 16)
    assert bm.full_kv_num_blocks[0, 0].tolist() == [3, 3]
    assert bm.full_kv_indices[0, 0, 0, :3].tolist() == [0, 1, 2]
