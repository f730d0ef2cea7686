"""Static widths of narrow BlockMask index tables (stage2_train/masks.py, the default).

The loader lays a batch's sequences end to end as one sequence, so a full index table is
[query tiles x key tiles] of the whole batch, although a query tile sees key tiles of its own
sequences only. These bounds say how many entries a row can hold, from shapes alone (a width
that followed the data would recompile the compiled flex region), so the tables can be cut to
them. Legend as in masks.py.
"""

from __future__ import annotations

import functools
import itertools
import math


def tiles_spanned(lo: int, hi: int, tile: int) -> int:
    """How many tiles of `tile` tokens hold some token of [lo, hi)."""
    return (hi - 1) // tile - lo // tile + 1 if hi > lo else 0


def _kv_width(
    num_seqs: int, seq_len: int, num_blocks: int, block_size: int, tile: int, rows: int
) -> int:
    """Most key tiles (partial + full) one query tile can touch, over every query tile.

    The m blocks of a query tile belong to at most min(m, b) sequences, and the blocks of
    sequence j see context only in [jS, jS + S - 1) (an anchor is at most the sequence's last
    token, which nobody sees), so at most the m largest of those ranges' tile counts; plus the
    tiles of the blocks' own slots, fixed by the tile's place. At S % TILE == 0 and B | TILE:
    min(TILE / B, b) * S / TILE + 1, reached by sequences of one document with one late anchor.
    `rows`: query rows of a block (B, or B * R with the query heads packed); its key slots: B.
    """
    ctx = num_seqs * seq_len
    seq_tiles = sorted(
        tiles_spanned(j * seq_len, (j + 1) * seq_len - 1, tile) for j in range(num_seqs)
    )
    top_m = [0, *itertools.accumulate(reversed(seq_tiles))]  # sum of the m largest
    context_cap = tiles_spanned(0, ctx - 1, tile)
    q_len = num_blocks * rows
    widest = 0
    for lo in range(0, q_len, tile):
        a0, a1 = lo // rows, (min(lo + tile, q_len) - 1) // rows
        context = min(top_m[min(a1 - a0 + 1, num_seqs)], context_cap)
        own = tiles_spanned(ctx + a0 * block_size, ctx + (a1 + 1) * block_size, tile)
        widest = max(widest, context + own)
    return widest


def _q_width(
    num_seqs: int, seq_len: int, per_seq: int, block_size: int, tile: int, rows: int
) -> int:
    """Most query tiles one key tile can be touched by, over every key tile.

    A context key seen by a block lies in that block's sequence, and collate lays each
    sequence's real blocks (at most A_s) side by side, so a key tile spanning k sequences is
    seen by the rows of a run of at most k * A_s consecutive blocks, wherever the run starts;
    a block key only by its own block's rows. At S % TILE == 0, B | TILE and A_s*B % TILE == 0:
    A_s * B / TILE + 1 (a run that starts mid-tile; + 0 for one sequence, which starts at 0).
    `rows` as in _kv_width: a run of blocks is a run of `rows` query rows each.
    """
    num_blocks, ctx = num_seqs * per_seq, num_seqs * seq_len
    kv_len = ctx + num_blocks * block_size
    period = tile // math.gcd(rows, tile)  # a run's start offset in its tile repeats

    @functools.cache
    def runtiles_spanned(run: int) -> int:
        starts = range(min(period, num_blocks - run + 1))
        return max(tiles_spanned(a * rows, (a + run) * rows, tile) for a in starts)

    widest = 0
    for lo in range(0, kv_len, tile):
        hi = min(lo + tile, kv_len)
        width = 0
        if lo < ctx:
            seqs = (min(hi, ctx) - 1) // seq_len - lo // seq_len + 1
            width += runtiles_spanned(min(seqs * per_seq, num_blocks))
        if hi > ctx:
            b0, b1 = (max(lo, ctx) - ctx) // block_size, (hi - 1 - ctx) // block_size
            width += tiles_spanned(b0 * rows, (b1 + 1) * rows, tile)
        widest = max(widest, width)
    return widest


@functools.cache
def narrow_widths(
    num_seqs: int,
    seq_len: int,
    anchors_per_seq: int,
    block_size: int,
    tile: int,
    rows_per_block: int | None = None,
) -> tuple[int, int]:
    """(kv, q) widths of narrow tables for a batch of `num_seqs` sequences of `seq_len` tokens
    laid end to end, each with `anchors_per_seq` anchor slots, as collate builds it.

    From shapes alone, never from the data: the width is a shape of the compiled flex region,
    and a width that followed each batch's largest row would recompile it. One width serves
    the partial and the full list of a side: what is bounded (and asserted at each build) is
    the tiles a row touches, partial + full; the full lists alone would fit in fewer columns,
    but then need a second bound for ~1/5 of the bytes. Capped at the full width.
    `rows_per_block`: query rows of a block (default B; B * R with the query heads packed).
    """
    rows = rows_per_block or block_size
    num_blocks = num_seqs * anchors_per_seq
    q_tiles = tiles_spanned(0, num_blocks * rows, tile)
    kv_tiles = tiles_spanned(0, num_seqs * seq_len + num_blocks * block_size, tile)
    return (
        min(_kv_width(num_seqs, seq_len, num_blocks, block_size, tile, rows), kv_tiles),
        min(_q_width(num_seqs, seq_len, anchors_per_seq, block_size, tile, rows), q_tiles),
    )
