"""The DFlash anchor-block attention mask: a mask_mod factory and a direct BlockMask builder.

Key/value layout of one packed sequence: ``[context tokens 0..S-1, then A*B block tokens]``;
query ``q`` is block slot ``q % B`` of anchor ``q // B``. A query of block ``b`` (anchor
``p_b``, document start ``s_b``) sees the context ``[s_b, p_b)`` (strictly before its
anchor: ``<=`` leaks the anchor's answer) and the B key slots of its own block, nothing
else: never another block, whatever the distance between anchors, and never another
document. Padding blocks (anchor -1) see only their own block, so no row is empty.

The mask is written in interval form (per-block ``[lo, hi)`` gathered by the query block
only): the fastest form measured in notes/performance.md. The BlockMask is built straight
from those intervals at 128x128 tile granularity, never through the dense token grid.

Legend: S context (= packed sequence) tokens, A anchors/blocks, B block size, Q = A*B query
tokens, KV = S + Q key tokens, QT/KT query/key tiles of ``TILE`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

TILE = 128  # the only BlockMask tile size that lowered on the H200 (notes/performance.md)

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
    ctx_lo_A: Tensor, ctx_hi_A: Tensor, context_len: int, block_size: int
) -> MaskMod:
    """mask_mod of the anchor-block mask (interval form, gathers by query block only).

    ``context_len`` and ``block_size`` are fixed for a run (they are shapes); the per-step
    anchors enter only as captured tensors, so a new mask never recompiles the kernel.
    """
    last_block = ctx_lo_A.numel() - 1

    def dflash_anchor_block(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Clamp: rows of a partly filled last query tile may index past the last block.
        blk = torch.clamp(q_idx // block_size, max=last_block)
        in_context = (kv_idx >= ctx_lo_A[blk]) & (kv_idx < ctx_hi_A[blk])
        own_lo = context_len + blk * block_size
        in_block = (kv_idx >= own_lo) & (kv_idx < own_lo + block_size)
        return in_context | in_block

    return dflash_anchor_block


def _covers(lo_N: Tensor, hi_N: Tensor, tile_lo_T: Tensor, tile_hi_T: Tensor) -> Tensor:
    """[N, T]: interval n contains the whole tile t."""
    return (lo_N[:, None] <= tile_lo_T[None, :]) & (hi_N[:, None] >= tile_hi_T[None, :])


def _touches(lo_N: Tensor, hi_N: Tensor, tile_lo_T: Tensor, tile_hi_T: Tensor) -> Tensor:
    """[N, T]: interval n (possibly empty) shares at least one token with tile t."""
    nonempty_N = hi_N > lo_N
    return (
        nonempty_N[:, None]
        & (lo_N[:, None] < tile_hi_T[None, :])
        & (hi_N[:, None] > tile_lo_T[None, :])
    )


def _ordered(dense_QK: Tensor) -> tuple[Tensor, Tensor]:
    """Tile flags [QT, KT] -> (num_blocks [1, 1, QT], indices [1, 1, QT, KT]) int32, ascending."""
    num_Q = dense_QK.sum(-1, dtype=torch.int32)
    # A stable sort of the negated flags lists the set tiles first, in ascending order.
    idx_QK = torch.argsort((~dense_QK).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num_Q[None, None], idx_QK[None, None]


def anchor_block_mask(
    ctx_lo_A: Tensor, ctx_hi_A: Tensor, context_len: int, block_size: int
) -> BlockMask:
    """BlockMask (B=1, H=None) of the anchor-block mask, built from the intervals directly.

    Cost is O(A * (QT + KT)) small tensor ops on the anchors' device, not O(Q * KV): the
    token grid is never materialised. Tiles are classified exactly like create_block_mask
    (partial = some but not all allowed; full = all 128x128 allowed, padding counts as
    masked), so the result equals create_block_mask's for the same mask_mod.
    """
    device = ctx_lo_A.device
    num_blocks = ctx_lo_A.numel()
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    n_q_tiles = -(-q_len // TILE)
    n_kv_tiles = -(-kv_len // TILE)

    kv_tile_lo_K = torch.arange(n_kv_tiles, device=device) * TILE
    kv_tile_hi_K = kv_tile_lo_K + TILE
    lo_A, hi_A = ctx_lo_A.long(), ctx_hi_A.long()
    own_lo_A = context_len + torch.arange(num_blocks, device=device) * block_size
    own_hi_A = own_lo_A + block_size

    touch_AK = _touches(lo_A, hi_A, kv_tile_lo_K, kv_tile_hi_K) | _touches(
        own_lo_A, own_hi_A, kv_tile_lo_K, kv_tile_hi_K
    )
    # The two intervals of a block never touch (hi = anchor <= S - 2 < S <= own_lo), so a
    # tile is covered by their union only if one of them covers it alone.
    cover_AK = _covers(lo_A, hi_A, kv_tile_lo_K, kv_tile_hi_K) | _covers(
        own_lo_A, own_hi_A, kv_tile_lo_K, kv_tile_hi_K
    )

    # member_QA: query tile i holds some row of block a.
    q_tile_lo_Q = torch.arange(n_q_tiles, device=device) * TILE
    member_QA = _touches(
        own_lo_A - context_len, own_hi_A - context_len, q_tile_lo_Q, q_tile_lo_Q + TILE
    ).T
    member_f = member_QA.float()
    any_QK = (member_f @ touch_AK.float()) > 0
    uncovered_QK = (member_f @ (~cover_AK).float()) > 0
    complete_Q = (q_tile_lo_Q + TILE) <= q_len  # padded rows are masked: never a full tile
    full_QK = any_QK & ~uncovered_QK & complete_Q[:, None]
    partial_QK = any_QK & ~full_QK

    kv_num, kv_idx = _ordered(partial_QK)
    full_num, full_idx = _ordered(full_QK)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=TILE,
        mask_mod=anchor_block_mask_mod(ctx_lo_A, ctx_hi_A, context_len, block_size),
        seq_lengths=(q_len, kv_len),
    )
