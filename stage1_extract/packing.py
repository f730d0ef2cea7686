"""The packing plan: which piece of which document goes where in the fixed-length sequences.

Pieces are placed in dataset order by one of two deterministic strategies (`packing.strategy`):
- `best_fit` (default): a piece goes into the open sequence with the least free room that
  still holds it, else it opens a new sequence. Padding is what extraction writes to disk and
  training computes on for nothing: on the benchmark's 200-4,000-token documents at 3,072
  tokens, next-fit left 19% of the stored positions as padding. O(P log seq_len).
- `next_fit`: a piece goes into the current sequence when it still fits, otherwise it opens
  the next one; documents stay in dataset order across the store. O(P).
Within a sequence, pieces sit back to back from offset 0 in the order they were placed.

Over-long documents (more than `seq_len` tokens) are either
- `split`: cut into consecutive pieces of `seq_len` tokens (the last one shorter), each then
  packed like a document of its own. Every piece is run through the target alone, so its
  positions restart at 0 and it sees none of the earlier pieces: piece `i` of a document is
  a new document as far as the target and the drafter are concerned; or
- `truncate`: only the first `seq_len` tokens are kept; the rest is counted in
  `dropped_tokens`.

The plan depends only on the document lengths, `seq_len` and `overlong`, so every process
computes the same plan, and shard `i` always holds sequences
`[i * sequences_per_shard, (i + 1) * sequences_per_shard)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PackingPlan:
    """Pieces in packing order; `sequence` is non-decreasing and pieces of one sequence are
    stored by increasing `start`, back to back from 0."""

    seq_len: int
    num_sequences: int
    doc_row: np.ndarray  # int64 [P] row of PreparedData.dataset for each stored piece
    src_offset: np.ndarray  # int64 [P] first token of the piece within its document
    length: np.ndarray  # int32 [P] tokens of the piece
    piece: np.ndarray  # int32 [P] 0 for the first piece, i for the i-th split piece
    sequence: np.ndarray  # int64 [P] global packed sequence index
    start: np.ndarray  # int32 [P] offset of the piece in its sequence
    split_documents: int  # documents cut into several pieces (overlong="split")
    truncated_documents: int  # documents cut to seq_len (overlong="truncate")
    dropped_tokens: int  # tokens cut away by truncation

    @property
    def num_pieces(self) -> int:
        return len(self.doc_row)


def _next_fit(lengths: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence index and start offset of each piece; a tight loop over Python ints, because
    next-fit is sequential by nature (about 0.3 s per million pieces on one CPU core)."""
    sequence = [0] * len(lengths)
    start = [0] * len(lengths)
    seq, used = 0, 0
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            seq += 1
            used = 0
        sequence[i] = seq
        start[i] = used
        used += n
    return np.asarray(sequence, dtype=np.int64), np.asarray(start, dtype=np.int32)


class _RoomIndex:
    """Open sequences grouped by their free room, with a segment tree over room values that
    finds the smallest room >= n holding a sequence in O(log seq_len)."""

    def __init__(self, seq_len: int) -> None:
        self.size = 1 << seq_len.bit_length()  # leaves 0..size-1 cover rooms 0..seq_len
        self.count = [0] * (2 * self.size)
        self.by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]

    def _bump(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.count[i] += delta
            i //= 2

    def add(self, room: int, sequence: int) -> None:
        self.by_room[room].append(sequence)
        self._bump(room, 1)

    def pop_fitting(self, n: int) -> tuple[int, int] | None:
        """(room, sequence) of an open sequence with the least room >= n, removed; or None."""
        i = n + self.size
        if not self.count[i]:
            # climb until a right sibling holds something: those siblings cover the rooms
            # above n in increasing order, so the first one found holds the smallest
            while i > 1 and not (i % 2 == 0 and self.count[i + 1]):
                i //= 2
            if i <= 1:
                return None
            i += 1
            while i < self.size:  # descend to its leftmost non-empty leaf
                i = 2 * i if self.count[2 * i] else 2 * i + 1
        room = i - self.size
        self._bump(room, -1)
        return room, self.by_room[room].pop()


def _best_fit(lengths: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence index and start offset of each piece (best fit in dataset order)."""
    sequence = [0] * len(lengths)
    start = [0] * len(lengths)
    rooms = _RoomIndex(seq_len)
    opened = 0
    for i, n in enumerate(lengths):
        found = rooms.pop_fitting(n)
        if found is None:
            seq, room = opened, seq_len
            opened += 1
        else:
            room, seq = found
        sequence[i] = seq
        start[i] = seq_len - room
        if room > n:
            rooms.add(room - n, seq)
    return np.asarray(sequence, dtype=np.int64), np.asarray(start, dtype=np.int32)


STRATEGIES = {"best_fit": _best_fit, "next_fit": _next_fit}


def plan_packing(
    lengths: np.ndarray, seq_len: int, overlong: str, strategy: str = "best_fit"
) -> PackingPlan:
    """Plan the packing of documents of token counts `lengths` (all >= 1, dataset order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if overlong not in ("split", "truncate"):
        raise ValueError(f"packing.overlong must be 'split' or 'truncate', got {overlong!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"packing.strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    if seq_len < 1:
        raise ValueError(f"packing.seq_len must be >= 1, got {seq_len}")
    # data.py drops empty documents; an empty one here would be a bug, not user input
    assert lengths.ndim == 1 and (lengths >= 1).all(), "documents must have >= 1 token"

    over = lengths > seq_len
    if overlong == "split":
        num_pieces = -(-lengths // seq_len)  # ceil division
        doc_row = np.repeat(np.arange(len(lengths), dtype=np.int64), num_pieces)
        # piece index within its document: position minus the position of the document's first
        first = np.cumsum(num_pieces) - num_pieces
        piece = np.arange(len(doc_row), dtype=np.int64) - np.repeat(first, num_pieces)
        src_offset = piece * seq_len
        length = np.minimum(seq_len, lengths[doc_row] - src_offset)
        split_documents, truncated_documents, dropped = int(over.sum()), 0, 0
    else:
        doc_row = np.arange(len(lengths), dtype=np.int64)
        piece = np.zeros(len(lengths), dtype=np.int64)
        src_offset = np.zeros(len(lengths), dtype=np.int64)
        length = np.minimum(lengths, seq_len)
        split_documents, truncated_documents = 0, int(over.sum())
        dropped = int((lengths - length).sum())

    sequence, start = STRATEGIES[strategy](length.tolist(), seq_len)
    # storage order: by sequence, then by offset (a no-op for next-fit)
    order = np.lexsort((start, sequence))
    return PackingPlan(
        seq_len=seq_len,
        num_sequences=int(sequence.max()) + 1 if len(sequence) else 0,
        doc_row=doc_row[order],
        src_offset=src_offset[order],
        length=length.astype(np.int32)[order],
        piece=piece.astype(np.int32)[order],
        sequence=sequence[order],
        start=start[order],
        split_documents=split_documents,
        truncated_documents=truncated_documents,
        dropped_tokens=dropped,
    )


def num_shards(plan: PackingPlan, sequences_per_shard: int) -> int:
    """Shards needed to hold every sequence of the plan (the last one may be partial)."""
    if sequences_per_shard < 1:
        raise ValueError(f"sequences_per_shard must be >= 1, got {sequences_per_shard}")
    return -(-plan.num_sequences // sequences_per_shard)


def shard_pieces(plan: PackingPlan, shard_index: int, sequences_per_shard: int) -> np.ndarray:
    """Indices (into the plan's arrays) of the pieces whose sequence falls in shard
    `shard_index`, i.e. in `[shard_index * N, (shard_index + 1) * N)`, in packing order."""
    if not 0 <= shard_index < num_shards(plan, sequences_per_shard):
        raise ValueError(
            f"shard {shard_index} is outside the plan's "
            f"{num_shards(plan, sequences_per_shard)} shards"
        )
    # `sequence` is sorted, so a shard's pieces form one contiguous run
    lo, hi = np.searchsorted(
        plan.sequence, [shard_index * sequences_per_shard, (shard_index + 1) * sequences_per_shard]
    )
    return np.arange(lo, hi, dtype=np.int64)


def padding_share(plan: PackingPlan) -> float:
    """Share of the plan's stored positions that are padding."""
    slots = plan.num_sequences * plan.seq_len
    return 1.0 - float(plan.length.sum()) / slots if slots else 0.0


def padding_hint(
    lengths: np.ndarray, plan: PackingPlan, overlong: str, strategy: str
) -> str | None:
    """A line for the user when packing wastes more than 5% of the store to padding because
    most documents share one length that `seq_len` is not a multiple of (what `dflash generate`
    writes: every text row is prompt_tokens + new_tokens long), naming the nearby seq_len that
    pads least; None when there is nothing to gain."""
    share = padding_share(plan)
    if share <= 0.05 or len(plan.length) == 0:
        return None
    values, counts = np.unique(plan.length, return_counts=True)
    common, count = int(values[counts.argmax()]), int(counts.max())
    if count < len(plan.length) / 2 or common >= plan.seq_len:
        return None
    fits = plan.seq_len // common
    options = {k * common for k in (fits, fits + 1)}
    padded = {
        seq_len: padding_share(plan_packing(lengths, seq_len, overlong, strategy))
        for seq_len in sorted(options)
    }
    best = min(padded, key=lambda seq_len: (padded[seq_len], abs(seq_len - plan.seq_len)))
    if padded[best] > share / 2:
        return None
    return (
        f"{share:.1%} of the stored positions would be padding (disk written and GPU time "
        f"spent for nothing in extract and train): {count / len(plan.length):.0%} of the "
        f"documents are {common} tokens and a {plan.seq_len}-token sequence holds {fits} of "
        f"them. --set packing.seq_len={best} would pad {padded[best]:.1%} "
        f"({best // common} per sequence)"
    )
