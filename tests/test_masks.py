"""The anchor-block mask against a mask built independently with plain loops.

Covers the peer bugs of notes/dflash.md: `<=` anchor leak, cross-block leak when anchors are
closer than the block size, document leak, padding, H = num_heads BlockMasks; the tile
tables the loader builds on CPU (collate) against create_block_mask and the device path; and
narrow tables (default; DFLASH_NARROW_MASK=0: full) against full ones, with their static
width's worst cases.

Legend: S context tokens, A anchors, B block size, Q = A*B queries, KV = S + Q keys.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from stage2_train.anchors import pad_anchors
from stage2_train.attention import BlockAttention
from stage2_train.data import collate
from stage2_train.mask_widths import narrow_widths
from stage2_train.masks import (
    TILE,
    MaskTables,
    anchor_block_mask,
    anchor_block_mask_mod,
    anchor_mask_tables,
    block_mask_from_tables,
    context_intervals,
    document_starts,
    widen,
)


def dense_mask(anchors: list[int], doc_ids: list[int], block_size: int) -> torch.Tensor:
    """Expected [Q, KV] mask from the definition, by loops (no intervals, no mask_mod)."""
    n_ctx, n_q = len(doc_ids), len(anchors) * block_size
    out = [[False] * (n_ctx + n_q) for _ in range(n_q)]  # Python lists: a tensor's per-element
    for q in range(n_q):  # assignment took ~3 us, 2 s for the largest mask here
        p = anchors[q // block_size]
        for kv in range(n_ctx + n_q):
            if kv < n_ctx:
                out[q][kv] = p >= 0 and kv < p and doc_ids[kv] == doc_ids[p]
            else:
                out[q][kv] = (kv - n_ctx) // block_size == q // block_size
    return torch.tensor(out, dtype=torch.bool).reshape(n_q, n_ctx + n_q)


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


def test_mask_mod_uses_no_op_flex_flash_cannot_lower() -> None:
    """flex's flash backend (CuteDSL) on torch 2.11 has no `minimum`, and a clamp lowers to it:
    its lowering of the mask failed on exactly that (forty-first session). The mask_mod's traced
    ops hold none; the dense comparison above holds its values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    doc_ids, anchors, bsz = CASES["partial_last_tile"]
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, bsz)
    mask_mod = anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz)
    rows = torch.arange(len(anchors) * bsz)  # every query row, those past the last block too
    graph = make_fx(mask_mod)(rows, rows, rows + 7, rows).graph
    ops = {str(node.target) for node in graph.nodes if node.op == "call_function"}
    assert not {op for op in ops if "clamp" in op or "minimum" in op or "min." in op}, ops


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


@pytest.mark.parametrize("heads_per_group", [2, 3, 4])
@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("case", CASES)
def test_packed_rows_block_mask_equals_create_block_mask(
    case: str, tile: int, heads_per_group: int
) -> None:
    """Query heads folded into rows (R rows a query, B * R a block; the key side keeps B slots
    a block): the direct tables equal create_block_mask's on the packed mask_mod, and what a
    kernel computes is the definition's mask with each query row repeated R times."""
    doc_ids, anchors, bsz = CASES[case]
    lo_A, hi_A, n_ctx = _make(doc_ids, anchors, bsz)
    rows = bsz * heads_per_group
    n_rows, n_kv = len(anchors) * rows, n_ctx + len(anchors) * bsz
    direct = anchor_block_mask(lo_A, hi_A, n_ctx, bsz, tile, rows_per_block=rows)
    mask_mod = anchor_block_mask_mod(lo_A, hi_A, n_ctx, bsz, rows_per_block=rows)
    ref = create_block_mask(mask_mod, 1, None, n_rows, n_kv, "cpu", BLOCK_SIZE=tile)
    assert direct.shape == ref.shape == (1, 1, n_rows, n_kv)
    qt, kt = -(-n_rows // tile), -(-n_kv // tile)
    assert all(
        torch.equal(d, r)
        for d, r in zip(_tile_flags(direct, qt, kt), _tile_flags(ref, qt, kt), strict=True)
    )
    assert torch.equal(direct.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(direct.full_kv_num_blocks, ref.full_kv_num_blocks)
    dense = dense_mask(anchors, doc_ids, bsz).repeat_interleave(heads_per_group, dim=0)
    _assert_kernel_sees(direct, dense, tile)


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


def _items(
    seed: int, block_size: int, seq_len: int = 400, num_anchors: int = 8, num_seqs: int = 3
) -> list[dict]:
    """Loader items of `num_seqs` sequences with random documents, padding tokens and fewer real
    anchors than the budget (padding anchors between sequences until collate sorts them);
    sequence 0 is one long document with late anchors, so that some tiles are full."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(num_seqs):
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
    batch = collate(_items(seed, bsz), narrow=False)
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


# --- Narrow tables (default; DFLASH_NARROW_MASK=0: full): index lists cut to a static width ---

SIDES = (  # (num_blocks, indices) pairs and the side whose width bounds them
    ("kv_num_blocks", "kv_indices", 0),
    ("full_kv_num_blocks", "full_kv_indices", 0),
    ("q_num_blocks", "q_indices", 1),
    ("full_q_num_blocks", "full_q_indices", 1),
)


def _listed_flags(num_1R: torch.Tensor, idx_1RW: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[R, n_cols] flags of the tiles each row lists in its first num_blocks entries."""
    flags = torch.zeros(num_1R.size(-1), n_cols, dtype=torch.bool)
    for r, n in enumerate(num_1R[0, 0].tolist()):
        flags[r, idx_1RW[0, 0, r, :n].long()] = True
    return flags


def _assert_narrow_matches_full(narrow: MaskTables, full: MaskTables, widths: tuple[int, int]):
    """Narrow lists read through num_blocks: the full lists' entries, in their order; the
    entries past num_blocks: tile 0 (a valid index). A side whose bound is the full width
    keeps the full lists."""
    for num_name, idx_name, side in SIDES:
        n_idx, f_idx = getattr(narrow, idx_name), getattr(full, idx_name)
        assert n_idx.shape == (*f_idx.shape[:-1], widths[side]), idx_name
        assert n_idx.is_contiguous() and n_idx.dtype == torch.int32, idx_name
        num = getattr(narrow, num_name)
        assert torch.equal(num, getattr(full, num_name)), num_name
        listed = torch.arange(widths[side]) < num[..., None]
        assert torch.equal(n_idx[listed], f_idx[..., : widths[side]][listed]), idx_name
        n_cols = f_idx.size(-1)
        assert torch.equal(n_idx, f_idx) if widths[side] == n_cols else not n_idx[~listed].any()
        flags = _listed_flags(num, n_idx, n_cols)
        assert torch.equal(flags, _listed_flags(num, f_idx, n_cols)), idx_name


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_narrow_tables_equal_full_tables(tile: int, num_seqs: int, seed: int) -> None:
    # random documents, padding tokens and padding anchors; 400 tokens: sequences straddle
    # tiles, so both the documents' and the sequences' boundaries fall inside tiles
    bsz, seq_len, per_seq = 16, 400, 8
    batch = collate(_items(seed, bsz, seq_len, per_seq, num_seqs), mask_tables=False)
    # (one sequence: sequence 0, one document with its whole budget of anchors)
    assert num_seqs == 1 or (batch.anchors_A < 0).any(), "the case must hold padding anchors"
    lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
    n_ctx = batch.document_ids_T.numel()
    widths = narrow_widths(num_seqs, seq_len, per_seq, bsz, tile)
    full = anchor_mask_tables(lo_A, hi_A, n_ctx, bsz, tile)
    narrow = anchor_mask_tables(lo_A, hi_A, n_ctx, bsz, tile, widths=widths)
    _assert_narrow_matches_full(narrow, full, widths)
    widened = widen(narrow, n_ctx, bsz, tile)
    for name in MaskTables._fields:
        assert torch.equal(getattr(widened, name), getattr(full, name)), name
    if num_seqs == 8:  # the point: far narrower than the grid
        assert widths[0] < full.kv_indices.size(-1) and widths[1] < full.q_indices.size(-1)


def test_collate_builds_narrow_tables_when_asked() -> None:
    items = _items(0, 16, num_seqs=8)
    narrow = collate(items, narrow=True).mask_tables
    full = collate(items, narrow=False).mask_tables
    assert isinstance(narrow, MaskTables) and isinstance(full, MaskTables)
    _assert_narrow_matches_full(narrow, full, narrow_widths(8, 400, 8, 16, TILE))


def _worst_items(
    num_seqs: int, seq_len: int, per_seq: int, block_size: int, real: list[int]
) -> list[dict]:
    """Sequences of one document each whose `real[j]` anchors are the last eligible positions
    (p + 1 still in the document), the rest of the budget padding."""
    items = []
    for num_real in real[:num_seqs]:
        anchors = torch.arange(seq_len - 1 - num_real, seq_len - 1)
        items.append(
            {
                "index": 0,
                "tokens_S": torch.zeros(seq_len, dtype=torch.long),
                "position_ids_S": torch.arange(seq_len),
                "document_ids_S": torch.zeros(seq_len, dtype=torch.long),
                "hidden_SKD": torch.zeros(seq_len, 1, 1),
                "anchors_A": pad_anchors(anchors, per_seq),
                "labels_AB": torch.zeros(per_seq, block_size, dtype=torch.long),
                "weights_AB": torch.zeros(per_seq, block_size),
            }
        )
    return items


def _touched(tables: MaskTables) -> tuple[int, int]:
    """Most tiles (partial + full) any kv-side row and any q-side row lists."""
    kv = tables.kv_num_blocks + tables.full_kv_num_blocks
    q = tables.q_num_blocks + tables.full_q_num_blocks
    return int(kv.max()), int(q.max())


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_static_width_is_reached_and_never_exceeded(tile: int, num_seqs: int) -> None:
    """The bound at S % TILE == 0 and B | TILE (the recipe's case) is the documented formula,
    and the worst cases reach it exactly, so a bound one smaller would drop tiles (the build
    asserts it): a query tile holding one late block of each of min(TILE/B, b) sequences
    (kv side); a sequence's full budget of late anchors starting mid-tile (q side)."""
    bsz, seq_len, per_seq = 16, 256, 16
    kv_w, q_w = narrow_widths(num_seqs, seq_len, per_seq, bsz, tile)
    assert kv_w == min(tile // bsz, num_seqs) * seq_len // tile + 1
    assert q_w == per_seq * bsz // tile + (num_seqs > 1)

    one_each = [1] * num_seqs  # every block of query tile 0 from another sequence
    # sequence 1's run starts at block 1; alone, a sequence's run starts at block 0
    late_run = [1, *[per_seq] * 7] if num_seqs > 1 else [per_seq]
    for real, side in ((one_each, 0), (late_run, 1)):
        items = _worst_items(num_seqs, seq_len, per_seq, bsz, real)
        batch = collate(items, mask_tables=False)
        lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
        args = (lo_A, hi_A, batch.document_ids_T.numel(), bsz, tile)
        full = anchor_mask_tables(*args)
        touched = _touched(full)
        assert touched[side] == (kv_w, q_w)[side], (side, touched)
        assert touched[0] <= kv_w and touched[1] <= q_w
        _assert_narrow_matches_full(
            anchor_mask_tables(*args, widths=(kv_w, q_w)), full, (kv_w, q_w)
        )
        smaller = [kv_w, q_w]
        smaller[side] -= 1
        with pytest.raises(AssertionError, match="width"):
            anchor_mask_tables(*args, widths=(smaller[0], smaller[1]))


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_static_width_holds_when_tiles_and_sequences_do_not_align(tile: int, num_seqs: int):
    """Worst-case anchors at 200-token sequences and blocks of 10 (neither divides a tile)."""
    bsz, seq_len, per_seq = 10, 200, 12
    widths = narrow_widths(num_seqs, seq_len, per_seq, bsz, tile)
    for real in ([1] * 8, [1, 12, 12, 3, 12, 1, 12, 12], [12] * 8):
        batch = collate(_worst_items(num_seqs, seq_len, per_seq, bsz, real), mask_tables=False)
        lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
        args = (lo_A, hi_A, batch.document_ids_T.numel(), bsz, tile)
        full = anchor_mask_tables(*args)
        touched = _touched(full)
        assert touched[0] <= widths[0] and touched[1] <= widths[1], (touched, widths)
        _assert_narrow_matches_full(anchor_mask_tables(*args, widths=widths), full, widths)


def test_narrow_widths_at_the_recipe_shape() -> None:
    """8 or 16 sequences of 3,072 tokens, 512 anchors of 16, 64-token tiles: 193 of the
    1,408 / 2,816 key tiles, 129 of the 1,024 / 2,048 query tiles."""
    assert narrow_widths(8, 3072, 512, 16, 64) == (193, 129)
    assert narrow_widths(16, 3072, 512, 16, 64) == (193, 129)
    assert narrow_widths(1, 3072, 512, 16, 64) == (49, 128)
    assert narrow_widths(8, 3072, 512, 16, 128) == (193, 65)


def test_narrow_block_mask_on_cpu_is_widened() -> None:
    """Flex's CPU lowering asserts the full width: off CUDA the BlockMask gets full tables."""
    items = _items(2, 16, num_seqs=3)
    batch = collate(items, narrow=False)
    narrow = collate(items, narrow=True).mask_tables
    assert batch.mask_tables is not None and narrow is not None
    assert narrow.kv_indices.size(-1) < batch.mask_tables.kv_indices.size(-1)
    n_ctx = batch.document_ids_T.numel()
    got = block_mask_from_tables(narrow, n_ctx, 16)
    want = block_mask_from_tables(batch.mask_tables, n_ctx, 16)
    assert got.shape == want.shape
    for name in TABLES:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_narrow_mask_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from stage2_train import masks

    monkeypatch.delenv("DFLASH_NARROW_MASK", raising=False)
    assert masks._narrow_from_env() is True
    monkeypatch.setenv("DFLASH_NARROW_MASK", "0")
    assert masks._narrow_from_env() is False
    monkeypatch.setenv("DFLASH_NARROW_MASK", "yes")
    with pytest.raises(ValueError, match="DFLASH_NARROW_MASK must be 0 or 1"):
        masks._narrow_from_env()


@pytest.mark.parametrize("heads_per_group", [3, 4])
@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_narrow_tables_hold_packed_rows(tile: int, num_seqs: int, heads_per_group: int) -> None:
    """With the query heads folded into rows (B * R rows a block), narrow_widths still bounds
    every row's tiles, on random batches and on the worst-case anchors of both sides, and the
    narrow tables widen back to the full ones."""
    bsz, seq_len, per_seq = 16, 400, 8
    rows = bsz * heads_per_group
    widths = narrow_widths(num_seqs, seq_len, per_seq, bsz, tile, rows_per_block=rows)
    batches = [collate(_items(0, bsz, seq_len, per_seq, num_seqs), mask_tables=False)]
    batches.append(collate(_items(1, bsz, seq_len, per_seq, num_seqs), mask_tables=False))
    for real in ([1] * 8, [1, *[per_seq] * 7], [per_seq] * 8):
        batches.append(
            collate(_worst_items(num_seqs, seq_len, per_seq, bsz, real), mask_tables=False)
        )
    for batch in batches:
        lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
        n_ctx = batch.document_ids_T.numel()
        args = (lo_A, hi_A, n_ctx, bsz, tile)
        full = anchor_mask_tables(*args, rows_per_block=rows)
        narrow = anchor_mask_tables(*args, widths=widths, rows_per_block=rows)
        _assert_narrow_matches_full(narrow, full, widths)
        widened = widen(narrow, n_ctx, bsz, tile, rows_per_block=rows)
        for name in MaskTables._fields:
            assert torch.equal(getattr(widened, name), getattr(full, name)), name
