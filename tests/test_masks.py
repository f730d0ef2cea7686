"""The anchor-block mask against a mask built independently with plain loops.

Covers the peer bugs of notes/dflash.md: `<=` anchor leak, cross-block leak when anchors are
closer than the block size, document leak, padding, H = num_heads BlockMasks; and the tile
tables the loader builds on CPU (collate) against create_block_mask and the device path.

Legend: S context tokens, A anchors, B block size, Q = A*B queries, KV = S + Q keys.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from stage2_train.anchors import pad_anchors
from stage2_train.attention import BlockAttention
from stage2_train.data import collate
from stage2_train.masks import (
    TILE,
    MaskTables,
    anchor_block_mask,
    anchor_block_mask_mod,
    block_mask_from_tables,
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
    # the last query tile is partly padding rows while all its blocks see context tiles 0-2
    "partial_last_tile": (packed([600], 0), list(range(500, 516)), 12),
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


def test_default_tile_is_64_and_env_can_choose_128(monkeypatch: pytest.MonkeyPatch) -> None:
    from stage2_train import masks

    assert TILE == 64  # what flex_tiles' kernel tiles are measured for
    monkeypatch.setenv("DFLASH_FLEX_TILE", "128")
    assert masks._tile_from_env() == 128
    monkeypatch.setenv("DFLASH_FLEX_TILE", "96")
    with pytest.raises(ValueError, match="DFLASH_FLEX_TILE must be 64 or 128"):
        masks._tile_from_env()


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("case", CASES)
def test_direct_block_mask_equals_create_block_mask(case: str, tile: int) -> None:
    doc_ids, anchors, bsz = CASES[case]
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, bsz)
    n_q = len(anchors) * bsz
    n_kv = n_ctx + n_q
    direct = anchor_block_mask(lo_A, hi_A, n_ctx, bsz, tile)
    ref = create_block_mask(
        anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz), 1, None, n_q, n_kv, "cpu", BLOCK_SIZE=tile
    )
    assert direct.kv_num_blocks.shape[:2] == (1, 1), "BlockMask must be built with H=None, B=1"
    assert direct.shape == ref.shape and direct.BLOCK_SIZE == ref.BLOCK_SIZE == (tile, tile)
    qt, kt = -(-n_q // tile), -(-n_kv // tile)
    d_part, d_full = _tile_flags(direct, qt, kt)
    r_part, r_full = _tile_flags(ref, qt, kt)
    assert torch.equal(d_part, r_part) and torch.equal(d_full, r_full)
    assert torch.equal(direct.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(direct.full_kv_num_blocks, ref.full_kv_num_blocks)

    _assert_kernel_sees(direct, dense_mask(anchors, doc_ids, bsz), tile)


def _assert_kernel_sees(bm: BlockMask, dense_QK: torch.Tensor, tile: int = TILE) -> None:
    """What a kernel would compute, full tiles all True and partial tiles through the
    mask_mod, is exactly the dense mask."""
    n_q, n_kv = dense_QK.shape
    part, full = _tile_flags(bm, -(-n_q // tile), -(-n_kv // tile))
    tile_q, tile_kv = torch.arange(n_q) // tile, torch.arange(n_kv) // tile
    full_tok = full[tile_q][:, tile_kv]
    part_tok = part[tile_q][:, tile_kv]
    assert torch.equal(full_tok | (part_tok & dense_QK), dense_QK), "a tile missing or not full"
    assert not (full_tok & ~dense_QK).any(), "a 'full' tile holds masked entries"


def test_full_tiles_exist_on_long_context() -> None:
    # 16 anchors deep in one 600-token document: at 128-token tiles, context tiles 0..2 are
    # full for all queries.
    doc_ids = packed([600], 0)
    anchors = list(range(500, 516))
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, 16)
    bm = anchor_block_mask(lo_A, hi_A, n_ctx, 16, tile=128)
    assert bm.full_kv_num_blocks[0, 0].tolist() == [3, 3]
    assert bm.full_kv_indices[0, 0, 0, :3].tolist() == [0, 1, 2]
    # 64-token tiles: context tiles 0..6 ([0, 448) < 500) are full for all four query tiles,
    # tile 7 ([448, 512)) too for the last, whose anchors are 512..515
    bm = anchor_block_mask(lo_A, hi_A, n_ctx, 16, tile=64)
    assert bm.full_kv_num_blocks[0, 0].tolist() == [7, 7, 7, 8]
    assert bm.full_kv_indices[0, 0, 0, :7].tolist() == list(range(7))


def _items(seed: int, block_size: int, seq_len: int = 400, num_anchors: int = 8) -> list[dict]:
    """Loader items of three sequences with random documents, padding tokens and fewer real
    anchors than the budget (padding anchors between sequences until collate sorts them);
    sequence 0 is one long document with late anchors, so that some tiles are full."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(3):
        if i == 0:
            docs_S = torch.zeros(seq_len, dtype=torch.long)
            picks = 300 + torch.randperm(seq_len - 300, generator=g)[:num_anchors]
        else:
            pad = int(torch.randint(0, 40, (), generator=g))
            cuts = torch.randint(1, seq_len - pad, (3,), generator=g)
            docs_S = torch.full((seq_len,), -1)
            docs_S[: seq_len - pad] = torch.bucketize(torch.arange(seq_len - pad), cuts.sort()[0])
            real = int(torch.randint(2, num_anchors + 1, (), generator=g))
            picks = torch.randperm(seq_len - pad, generator=g)[:real]
        anchors_A = pad_anchors(picks.sort()[0], num_anchors)
        items.append(
            {
                "index": i,
                "tokens_S": torch.zeros(seq_len, dtype=torch.long),
                "position_ids_S": torch.arange(seq_len),
                "document_ids_S": docs_S,
                "hidden_SKD": torch.zeros(seq_len, 1, 1),
                "anchors_A": anchors_A,
                "labels_AB": torch.zeros(num_anchors, block_size, dtype=torch.long),
                "weights_AB": torch.zeros(num_anchors, block_size),
            }
        )
    return items


TABLES = [name for name in MaskTables._fields if not name.startswith("ctx_")]


# 16: the trained size, B | TILE; 10: blocks straddle query tiles; 200: a block spans three.
@pytest.mark.parametrize("bsz", [16, 10, 200])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_collate_tables_equal_device_built_and_create_block_mask(bsz: int, seed: int) -> None:
    batch = collate(_items(seed, bsz))
    tables = batch.mask_tables
    anchors_A, docs_T = batch.anchors_A, batch.document_ids_T
    n_ctx, n_q = docs_T.numel(), anchors_A.numel() * bsz
    lo_A, hi_A = context_intervals(anchors_A, docs_T)
    assert isinstance(tables, MaskTables)
    assert torch.equal(tables.ctx_lo_A, lo_A) and torch.equal(tables.ctx_hi_A, hi_A)
    mask_mod = anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz)
    ref = create_block_mask(mask_mod, 1, None, n_q, n_ctx + n_q, "cpu", BLOCK_SIZE=TILE)
    built_here = BlockAttention(anchors_A, docs_T, bsz, backend="flex").block_mask
    assert built_here is not None
    for name in TABLES:
        got = getattr(tables, name)
        assert got.dtype == torch.int32, name
        assert torch.equal(got, getattr(ref, name)), name
        assert torch.equal(got, getattr(built_here, name)), name

    # Assembled on "the device" from the batch's tables, as the training step does.
    moved = batch.to(torch.device("cpu")).mask_tables
    assert isinstance(moved, MaskTables)
    assembled = block_mask_from_tables(moved, n_ctx, bsz)
    via_kv_blocks = BlockMask.from_kv_blocks(
        *(getattr(moved, name) for name in TABLES[:4]),
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(n_q, n_ctx + n_q),
    )
    assert assembled.shape == via_kv_blocks.shape == ref.shape
    assert assembled.BLOCK_SIZE == via_kv_blocks.BLOCK_SIZE
    assert torch.equal(assembled.to_dense(), via_kv_blocks.to_dense())
    for name in TABLES:
        assert torch.equal(getattr(assembled, name), getattr(via_kv_blocks, name)), name
    if bsz == 16:  # the long document's late anchors fill query tile 0: full tiles exist
        assert tables.full_kv_num_blocks[0, 0, 0] > 0

    if seed == 0 and bsz != 200:
        dense = dense_mask(anchors_A.tolist(), docs_T.tolist(), bsz)
    else:  # the loop reference is slow: the mask_mod's (tested equal to it above)
        dense = create_mask(mask_mod, 1, 1, n_q, n_ctx + n_q, "cpu")[0, 0]
    _assert_kernel_sees(assembled, dense)
