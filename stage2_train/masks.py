"""The DFlash anchor-block attention mask: a mask_mod factory and its BlockMask tile tables.

Key/value layout of one packed sequence: ``[context tokens 0..S-1, then A*B block tokens]``;
query ``q`` is block slot ``q % B`` of anchor ``q // B``. A query of block ``b`` (anchor
``p_b``, document start ``s_b``) sees the context ``[s_b, p_b)`` (strictly before its
anchor: ``<=`` leaks the anchor's answer) and the B key slots of its own block, nothing
else: never another block, whatever the distance between anchors, and never another
document. Padding blocks (anchor -1) see only their own block, so no row is empty.

The mask is written in interval form (per-block ``[lo, hi)`` gathered by the query block
only): the fastest form measured in notes/performance.md. The BlockMask's tile tables are
built straight from those intervals in tiles of TILE x TILE tokens (64: stage2_train/flex_tiles.py
says why), never through the dense token grid, as plain tensors (`MaskTables`,
`anchor_mask_tables`): in training the loader's workers build them on CPU (stage2_train/batch.py
collate; narrow ones from the touched tiles alone, ~12-18 ms of one core at 16 x 3,072 tokens
and 8,192 blocks of 16, full ones through the [QT, KT] grid, ~200-300 ms), and
`block_mask_from_tables` assembles the BlockMask on the device without launching a kernel.

Narrow tables (the default; ``DFLASH_NARROW_MASK=0`` builds full ones; bench/flex_gate.py's
narrow case, bitwise equal to full tables on the H200 with torch 2.11, checks a new torch):
the batch is one concatenated sequence, so the index lists are [QT, KT] over the whole batch,
although a query tile only ever sees key tiles of its own sequences and a key tile only query
tiles of its own sequence. flex_attention's GPU kernels read only the first
``num_blocks[row]`` entries of a row, so collate cuts the lists to the static `narrow_widths`
(23 MB -> 3 MB a batch at 8 x 3,072 tokens, 64-token tiles), each row's tiles then zeros.

Legend: S context (= packed sequence) tokens, A anchors/blocks, B block size, Q = A*B query
tokens, KV = S + Q key tokens, QT/KT query/key tiles of ``TILE`` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from stage2_train.mask_lists import narrow_lists, ordered_lists, touched_tiles
from stage2_train.mask_widths import tiles_spanned


def _tile_from_env() -> int:
    """BlockMask tile size: 64 tokens (1.43x faster attention with stage2_train/flex_tiles.py's
    kernel tiles, H200), or DFLASH_FLEX_TILE=128 for a torch those hooks do not fit."""
    value = os.environ.get("DFLASH_FLEX_TILE", "64")
    if value not in ("64", "128"):
        raise ValueError(f"DFLASH_FLEX_TILE must be 64 or 128, got {value!r}")
    return int(value)


def _narrow_from_env() -> bool:
    """Collate builds the tables at `narrow_widths` (default, DFLASH_NARROW_MASK=1) or at full
    width (DFLASH_NARROW_MASK=0, for a torch whose flex kernels bench/flex_gate.py rejects)."""
    value = os.environ.get("DFLASH_NARROW_MASK", "1")
    if value not in ("0", "1"):
        raise ValueError(f"DFLASH_NARROW_MASK must be 0 or 1, got {value!r}")
    return value == "1"


TILE = _tile_from_env()  # the loader's workers inherit the environment, so they agree
NARROW = _narrow_from_env()

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def document_starts(document_ids_S: Tensor) -> Tensor:
    """First position of the document holding each position (int64, [S])."""
    pos_S = torch.arange(document_ids_S.numel(), device=document_ids_S.device)
    is_start_S = torch.ones_like(document_ids_S, dtype=torch.bool)
    is_start_S[1:] = document_ids_S[1:] != document_ids_S[:-1]
    return torch.where(is_start_S, pos_S, 0).cummax(0).values


def context_intervals(anchors_A: Tensor, document_ids_S: Tensor) -> tuple[Tensor, Tensor]:
    """Per block, the visible context ``[lo, hi)`` = [document start, anchor) as int32 [A].

    Padding anchors (-1) get the empty interval [0, 0).
    """
    valid_A = anchors_A >= 0
    safe_A = anchors_A.clamp(min=0)
    lo_A = torch.where(valid_A, document_starts(document_ids_S)[safe_A], 0)
    hi_A = torch.where(valid_A, safe_A, 0)
    return lo_A.to(torch.int32), hi_A.to(torch.int32)


def anchor_block_mask_mod(
    ctx_lo_A: Tensor,
    ctx_hi_A: Tensor,
    context_len: int,
    block_size: int,
    rows_per_block: int | None = None,
) -> MaskMod:
    """mask_mod of the anchor-block mask (interval form, gathers by query block only).

    ``context_len`` and ``block_size`` are fixed for a run (they are shapes); the per-step
    anchors enter only as captured tensors, so a new mask never recompiles the kernel.
    ``rows_per_block`` (default B): query rows of one block, B * R when the R query heads of a
    key/value group are folded into the rows (`pack_heads`); the key side keeps B slots a block.
    """
    last_block = ctx_lo_A.numel() - 1
    rows = rows_per_block or block_size

    def dflash_anchor_block(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Rows of a partly filled last query tile may index past the last block: held to it.
        # A where, not a clamp: flex's flash backend (CuteDSL) on torch 2.11 cannot lower
        # `minimum`, which a clamp becomes (forty-first session); same values.
        blk = q_idx // rows
        blk = torch.where(blk > last_block, last_block, blk)
        in_context = (kv_idx >= ctx_lo_A[blk]) & (kv_idx < ctx_hi_A[blk])
        own_lo = context_len + blk * block_size
        in_block = (kv_idx >= own_lo) & (kv_idx < own_lo + block_size)
        return in_context | in_block

    return dflash_anchor_block


class MaskTables(NamedTuple):
    """The anchor-block mask of one packed sequence as plain int32 tensors, nothing built on
    them: the context intervals the mask_mod reads and the BlockMask's tile lists, kv side
    (forward) and q side (backward), in the layout BlockMask.from_kv_blocks would produce.

    Pure data, so the loader's workers build it on CPU and `Batch.to` moves it with the batch;
    `block_mask_from_tables` then assembles the BlockMask on the device without a kernel.
    """

    ctx_lo_A: Tensor
    ctx_hi_A: Tensor
    kv_num_blocks: Tensor  # [1, 1, QT] partial (mask_mod) key tiles of each query tile
    kv_indices: Tensor  # [1, 1, QT, KT or narrow kv width] those tiles first, ascending
    full_kv_num_blocks: Tensor  # [1, 1, QT] full (all visible) key tiles
    full_kv_indices: Tensor  # [1, 1, QT, KT or narrow kv width]
    q_num_blocks: Tensor  # [1, 1, KT] the transpose of the partial lists
    q_indices: Tensor  # [1, 1, KT, QT or narrow q width]
    full_q_num_blocks: Tensor  # [1, 1, KT] the transpose of the full lists
    full_q_indices: Tensor  # [1, 1, KT, QT or narrow q width]


def anchor_mask_tables(
    ctx_lo_A: Tensor,
    ctx_hi_A: Tensor,
    context_len: int,
    block_size: int,
    tile: int = TILE,
    widths: tuple[int, int] | None = None,
    rows_per_block: int | None = None,
) -> MaskTables:
    """The tile tables of the anchor-block mask, built from the intervals on their device;
    with ``widths = (kv, q)`` (`narrow_widths`) the kv-side and q-side index lists keep only
    their first kv and q entries, asserted to hold every row's partial and full tiles.
    ``rows_per_block``: query rows of one block (default B; B * R with `pack_heads`).

    Never the token grid nor an [A, KT] table: the rows of query tile i belong to a run of
    consecutive blocks, so what those rows see is summarised per tile. Tile (i, k) is
    touched if some block's context or own slots share a token with key tile k (the own slots
    of a run being one interval): full tables mark them on the [QT, KT] grid (O(A + QT * KT),
    a difference array over key tiles), narrow ones list them from the intervals' sorted ends
    (O(A log A + touched tiles), mask_lists.touched_tiles). It is full if every row sees all
    of it, i.e. if the intersection of the run's context intervals, or of its own-slot
    intervals, contains it: a row's two intervals never meet (hi = anchor < S <= own_lo,
    token S-1 seen by none), so one of them alone must cover the tile. Tiles are classified
    exactly like create_block_mask (partial = some but not all allowed; full = all TILE x TILE
    allowed, padding rows and keys count as masked), so the tables equal create_block_mask's
    for the same mask_mod.
    """
    device = ctx_lo_A.device
    num_blocks = ctx_lo_A.numel()
    rows = rows_per_block or block_size  # query rows of a block (its key slots: block_size)
    q_len = num_blocks * rows
    kv_len = context_len + num_blocks * block_size
    n_q_tiles = -(-q_len // tile)
    n_kv_tiles = -(-kv_len // tile)
    kv_tile_lo_K = torch.arange(n_kv_tiles, device=device) * tile
    kv_tile_hi_K = kv_tile_lo_K + tile

    # Query tiles of each block's rows: one when the rows divide tile, else up to `span`
    # (clamped repeats are harmless below: max, min and "touched" are idempotent).
    span = 1 if tile % rows == 0 else (rows - 1) // tile + 2
    block_A = torch.arange(num_blocks, device=device)
    first_A = block_A * rows // tile
    last_A = ((block_A + 1) * rows - 1) // tile
    tile_N = torch.minimum(
        first_A[:, None] + torch.arange(span, device=device), last_A[:, None]
    ).flatten()
    lo_N = ctx_lo_A.long().repeat_interleave(span)
    hi_N = ctx_hi_A.long().repeat_interleave(span)

    # Context, covered by every row: the intersection [max lo, min hi) of the tile's blocks.
    # (Every query tile holds some block, so include_self=False never keeps the zeros.)
    zeros_Q = torch.zeros(n_q_tiles, dtype=torch.long, device=device)
    ctx_lo_Q = zeros_Q.scatter_reduce(0, tile_N, lo_N, "amax", include_self=False)
    ctx_hi_Q = zeros_Q.scatter_reduce(0, tile_N, hi_N, "amin", include_self=False)
    # Own slots: tile i holds blocks a0..a1, whose slots are [S + a0*B, S + (a1+1)*B) together
    # and [S + a1*B, S + (a0+1)*B) in common (empty unless a0 == a1).
    q_tile_lo_Q = torch.arange(n_q_tiles, device=device) * tile
    a0_Q = q_tile_lo_Q // rows
    a1_Q = (torch.clamp(q_tile_lo_Q + tile, max=q_len) - 1) // rows
    union_lo_Q = context_len + a0_Q * block_size
    union_hi_Q = context_len + (a1_Q + 1) * block_size
    own_lo_Q = context_len + a1_Q * block_size
    own_hi_Q = context_len + (a0_Q + 1) * block_size
    complete_Q = (q_tile_lo_Q + tile) <= q_len  # padded rows are masked: never a full tile

    if widths is not None:  # the touched tiles as entries (E), never the [QT, KT] grid
        # a context [lo, hi) touches key tiles lo // tile .. (hi - 1) // tile (none if empty),
        # the own slots of a query tile those of their union
        row_M = torch.cat([tile_N, torch.arange(n_q_tiles, device=device)])
        first_M = torch.cat([lo_N // tile, union_lo_Q // tile])
        last_N = torch.where(hi_N > lo_N, (hi_N - 1) // tile, -1)
        last_M = torch.cat([last_N, (union_hi_Q - 1) // tile])
        row_E, col_E = touched_tiles(row_M, first_M, last_M, n_kv_tiles)
        key_lo_E, key_hi_E = col_E * tile, col_E * tile + tile
        full_E = (ctx_lo_Q[row_E] <= key_lo_E) & (ctx_hi_Q[row_E] >= key_hi_E)
        full_E |= (own_lo_Q[row_E] <= key_lo_E) & (own_hi_Q[row_E] >= key_hi_E)
        full_E &= complete_Q[row_E]
        lists = narrow_lists(row_E, col_E, full_E, (n_q_tiles, n_kv_tiles), widths)
        return MaskTables(ctx_lo_A, ctx_hi_A, *(t for pair in lists for t in pair))

    # Context, touched: +1 at the first key tile of each nonempty interval, -1 past its last.
    diff_QK = torch.zeros(n_q_tiles, n_kv_tiles + 1, dtype=torch.int32, device=device)
    one_N = (hi_N > lo_N).to(torch.int32)
    diff_QK.index_put_((tile_N, lo_N // tile), one_N, accumulate=True)
    diff_QK.index_put_((tile_N, (hi_N - 1) // tile + 1), -one_N, accumulate=True)
    touch_QK = diff_QK.cumsum(-1)[:, :n_kv_tiles] > 0
    cover_QK = (ctx_lo_Q[:, None] <= kv_tile_lo_K) & (ctx_hi_Q[:, None] >= kv_tile_hi_K)
    touch_QK |= (union_lo_Q[:, None] < kv_tile_hi_K) & (union_hi_Q[:, None] > kv_tile_lo_K)
    cover_QK |= (own_lo_Q[:, None] <= kv_tile_lo_K) & (own_hi_Q[:, None] >= kv_tile_hi_K)
    full_QK = touch_QK & cover_QK & complete_Q[:, None]
    partial_QK = touch_QK & ~full_QK
    lists = [ordered_lists(partial_QK), ordered_lists(full_QK)]
    lists += [ordered_lists(partial_QK.T), ordered_lists(full_QK.T)]
    return MaskTables(ctx_lo_A, ctx_hi_A, *(t for pair in lists for t in pair))


def _widened(num_1Q: Tensor, idx_1QW: Tensor, n_cols: int) -> tuple[Tensor, Tensor]:
    """Full-width (num_blocks, indices) from a narrow pair: its first num entries per row."""
    if idx_1QW.size(-1) == n_cols:
        return num_1Q, idx_1QW
    idx_QW = idx_1QW[0, 0].long()
    listed_QW = torch.arange(idx_QW.size(1), device=idx_QW.device) < num_1Q[0, 0, :, None]
    flags_QK = torch.zeros(idx_QW.size(0), n_cols + 1, dtype=torch.bool, device=idx_QW.device)
    flags_QK.scatter_(-1, torch.where(listed_QW, idx_QW, n_cols), True)  # the rest: scratch
    return ordered_lists(flags_QK[:, :n_cols])


def widen(
    tables: MaskTables,
    context_len: int,
    block_size: int,
    tile: int = TILE,
    rows_per_block: int | None = None,
) -> MaskTables:
    """Tables of full width (equal entry for entry to those built without widths) from narrow
    ones; full tables come back as they are."""
    rows = rows_per_block or block_size
    q_tiles = tiles_spanned(0, tables.ctx_lo_A.numel() * rows, tile)
    kv_tiles = tiles_spanned(0, context_len + tables.ctx_lo_A.numel() * block_size, tile)
    return MaskTables(
        tables.ctx_lo_A,
        tables.ctx_hi_A,
        *_widened(tables.kv_num_blocks, tables.kv_indices, kv_tiles),
        *_widened(tables.full_kv_num_blocks, tables.full_kv_indices, kv_tiles),
        *_widened(tables.q_num_blocks, tables.q_indices, q_tiles),
        *_widened(tables.full_q_num_blocks, tables.full_q_indices, q_tiles),
    )


def block_mask_from_tables(
    tables: MaskTables,
    context_len: int,
    block_size: int,
    tile: int = TILE,
    rows_per_block: int | None = None,
) -> BlockMask:
    """BlockMask (B=1, H=None) of the anchor-block mask from tables already on its device.

    No tensor op runs on CUDA: the tables are taken as they are (from_kv_blocks would
    transpose the kv lists on the device; the q lists come ready) and the mask_mod only
    captures tensors. Narrow tables stay narrow there (the Triton kernels read num_blocks
    entries of a row), and seq_lengths is given because torch would infer the key length from
    the width; elsewhere they are widened first (flex's CPU lowering asserts the full width).
    A narrow BlockMask must not be densified, sliced or `_adjust`-ed: torch's to_dense and
    _transpose_ordered take the index width for the number of tiles.
    """
    if tables.kv_indices.device.type != "cuda":
        tables = widen(tables, context_len, block_size, tile, rows_per_block)
    num_blocks = tables.ctx_lo_A.numel()
    q_len = num_blocks * (rows_per_block or block_size)
    return BlockMask(
        seq_lengths=(q_len, context_len + num_blocks * block_size),
        kv_num_blocks=tables.kv_num_blocks,
        kv_indices=tables.kv_indices,
        full_kv_num_blocks=tables.full_kv_num_blocks,
        full_kv_indices=tables.full_kv_indices,
        q_num_blocks=tables.q_num_blocks,
        q_indices=tables.q_indices,
        full_q_num_blocks=tables.full_q_num_blocks,
        full_q_indices=tables.full_q_indices,
        BLOCK_SIZE=(tile, tile),
        mask_mod=anchor_block_mask_mod(
            tables.ctx_lo_A, tables.ctx_hi_A, context_len, block_size, rows_per_block
        ),
    )


def anchor_block_mask(
    ctx_lo_A: Tensor,
    ctx_hi_A: Tensor,
    context_len: int,
    block_size: int,
    tile: int = TILE,
    rows_per_block: int | None = None,
) -> BlockMask:
    """BlockMask of the anchor-block mask, tables built on the intervals' device."""
    tables = anchor_mask_tables(
        ctx_lo_A, ctx_hi_A, context_len, block_size, tile, rows_per_block=rows_per_block
    )
    return block_mask_from_tables(tables, context_len, block_size, tile, rows_per_block)
