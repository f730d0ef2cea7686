"""The BlockMask index lists of stage2_train/masks.py, from tile flags or from touched tiles.

Full-width lists (`ordered_lists`) come from a dense [QT, KT] flag grid, as create_block_mask
lays them out. Narrow lists (`narrow_lists`, the loader's default) come from the touched tiles
alone (`touched_tiles`: the union of each query tile's key-tile ranges, from sorted range ends),
never from the grid: at 16 sequences of 3,072 tokens and 8,192 blocks of 16 the grid holds 5.8M
tiles, of which ~100k are touched, and its cumsum, nonzero and comparisons were most of the
tables' CPU time (bench/loader_cost.py). Legend as in masks.py; M key-tile ranges, V their
ends, E touched tiles (entries), N set tiles of one list.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ordered_lists(flags_QK: Tensor) -> tuple[Tensor, Tensor]:
    """Tile flags [QT, KT] -> (num_blocks [1, 1, QT], indices [1, 1, QT, KT]) int32.

    Each row lists its set tiles first, ascending, then the others, ascending: what
    create_block_mask's stable argsort gives, here by ranks and one scatter (no sort).
    """
    flags_QK = flags_QK.contiguous()  # the q-side lists come from a transposed view
    # int32 throughout: a quarter of the tables' bytes at 64-token tiles go through these ops
    seen_QK = flags_QK.cumsum(-1, dtype=torch.int32)  # set tiles at or before each column
    num_Q = seen_QK[:, -1]
    cols_K = torch.arange(flags_QK.size(1), dtype=torch.int32, device=flags_QK.device)
    # set tile: its rank among set tiles; other tile: num + its rank among the others
    slot_QK = torch.where(flags_QK, seen_QK - 1, num_Q[:, None] + cols_K - seen_QK)
    idx_QK = torch.empty(flags_QK.shape, dtype=torch.int32, device=flags_QK.device)
    idx_QK.scatter_(-1, slot_QK.long(), cols_K.expand_as(idx_QK))
    return num_Q[None, None], idx_QK[None, None]


def _listed(major_N: Tensor, minor_N: Tensor, rows: int, width: int) -> tuple[Tensor, Tensor]:
    """Set tiles as entries sorted by (major, minor) -> (num_blocks [1, 1, rows], indices
    [1, 1, rows, width]) int32: each row lists its tiles, ascending, then zeros. Tile 0 is a
    valid index, and the kernels stop at num_blocks (after loading a row's first entry,
    whatever num_blocks: hence width >= 1)."""
    num_R = torch.bincount(major_N, minlength=rows).to(torch.int32)
    first_R = num_R.cumsum(0) - num_R  # where each row's entries start
    rank_N = torch.arange(major_N.numel(), device=major_N.device) - first_R[major_N]
    idx_RW = torch.zeros(rows, width, dtype=torch.int32, device=major_N.device)
    idx_RW[major_N, rank_N] = minor_N.to(torch.int32)
    return num_R[None, None], idx_RW[None, None]


def touched_tiles(
    row_M: Tensor, first_M: Tensor, last_M: Tensor, cols: int
) -> tuple[Tensor, Tensor]:
    """The tiles (row, col) covered by some range [first, last] of key tiles given per row
    (any order, overlapping or not; first > last: empty), as entries in row-major order,
    columns ascending in a row (what `flags.nonzero()` gives), without a [rows, cols] grid:
    +1 at each range's first tile, -1 past its last, sorted; where the running count is
    positive, the columns up to the next end are covered."""
    keep_M = first_M <= last_M
    row_M, first_M, last_M = row_M[keep_M], first_M[keep_M], last_M[keep_M]
    stride = cols + 1  # a range ends at most at column `cols`: it never reaches the next row
    ends_V = torch.cat([row_M * stride + first_M, row_M * stride + last_M + 1])
    steps_V = torch.cat([torch.ones_like(row_M), -torch.ones_like(row_M)])
    order_V = torch.argsort(ends_V)
    ends_V, count_V = ends_V[order_V], steps_V[order_V].cumsum(0)
    # segment v: columns [end v, end v+1) of end v's row, covered when count_V[v] > 0
    length_V = torch.where(count_V[:-1] > 0, ends_V[1:] - ends_V[:-1], 0)
    start_V = ends_V[:-1]
    total, device = int(length_V.sum()), row_M.device
    segments_V = torch.arange(length_V.numel(), device=device)
    seg_E = torch.repeat_interleave(segments_V, length_V, output_size=total)
    offset_E = torch.arange(total, device=device) - (length_V.cumsum(0) - length_V)[seg_E]
    key_E = start_V[seg_E] + offset_E
    return key_E // stride, key_E % stride


def narrow_lists(
    row_E: Tensor, col_E: Tensor, full_E: Tensor, grid: tuple[int, int], widths: tuple[int, int]
) -> list[tuple[Tensor, Tensor]]:
    """The four (num_blocks, indices) pairs (partial and full, kv side then q side) cut to
    `widths`, from the touched tiles (row-major, columns ascending) and which of them are
    full: the kv side lists them as they come, the q side sorted by column. A side whose width
    is the whole grid keeps `ordered_lists`' layout (from flags made of the entries). Asserts
    that every row's tiles, partial and full, fit its width: the bound of
    `mask_widths.narrow_widths`."""
    (n_q, n_kv), (kv_width, q_width) = grid, widths
    assert kv_width >= 1 and q_width >= 1, widths
    most = (int(torch.bincount(row_E).max()), int(torch.bincount(col_E).max()))
    assert most[0] <= kv_width and most[1] <= q_width, ("width", most, widths)
    by_col_E = torch.sort(col_E, stable=True).indices  # column-major, rows ascending
    kv_side = (row_E, col_E, full_E, n_q, n_kv, kv_width)
    q_side = (col_E[by_col_E], row_E[by_col_E], full_E[by_col_E], n_kv, n_q, q_width)
    lists = []
    for rows_E, cols_E, whole_E, n_rows, n_cols, width in (kv_side, q_side):
        if width >= n_cols:
            touch = torch.zeros(n_rows, n_cols, dtype=torch.bool, device=rows_E.device)
            touch[rows_E, cols_E] = True
            full = torch.zeros_like(touch)
            full[rows_E[whole_E], cols_E[whole_E]] = True
            lists += [ordered_lists(touch & ~full), ordered_lists(full)]
        else:
            lists.append(_listed(rows_E[~whole_E], cols_E[~whole_E], n_rows, width))
            lists.append(_listed(rows_E[whole_E], cols_E[whole_E], n_rows, width))
    return lists
