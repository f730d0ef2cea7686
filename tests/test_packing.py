"""The packing plan: every token placed once, no overlap; next-fit against a brute force,
best-fit checked piece by piece against the rooms a by-hand replay sees."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from stage1_extract.packing import (
    num_shards,
    padding_hint,
    padding_share,
    plan_packing,
    shard_pieces,
)


def reference_pack(lengths: list[int], seq_len: int, overlong: str) -> list[list[tuple]]:
    """Next-fit by hand on explicit tokens: sequences as lists of (doc, token, piece, position)."""
    sequences: list[list[tuple]] = [[]]
    for doc, n in enumerate(lengths):
        tokens = list(range(n if overlong == "split" else min(n, seq_len)))
        pieces = [tokens[i : i + seq_len] for i in range(0, len(tokens), seq_len)]
        for p, piece in enumerate(pieces):
            if len(sequences[-1]) + len(piece) > seq_len:
                sequences.append([])
            sequences[-1] += [(doc, t, p, pos) for pos, t in enumerate(piece)]
    return sequences if sequences[0] else []


def random_cases(seed: int):
    """150 (trial, seq_len, document lengths) cases: short and over-long documents mixed."""
    rng = np.random.default_rng(seed)
    for trial in range(150):
        seq_len = int(rng.integers(1, 40))
        yield trial, seq_len, rng.integers(1, 3 * seq_len + 2, size=int(rng.integers(0, 30)))


def plan_tokens(plan) -> list[list[tuple]]:
    """The same view rebuilt from a plan: what each sequence slot holds, padding left out."""
    slots: list[dict[int, tuple]] = [{} for _ in range(plan.num_sequences)]
    for i in range(plan.num_pieces):
        for pos in range(plan.length[i]):
            slot = int(plan.start[i]) + pos
            assert slot not in slots[plan.sequence[i]], "two pieces overlap"
            token = int(plan.src_offset[i]) + pos
            slots[plan.sequence[i]][slot] = (int(plan.doc_row[i]), token, int(plan.piece[i]), pos)
    out = []
    for seq in slots:
        assert sorted(seq) == list(range(len(seq))), "pieces must sit back to back from 0"
        out.append([seq[k] for k in sorted(seq)])
    return out


def test_split_small_example():
    plan = plan_packing(
        np.array([3, 10, 2, 4, 1]), seq_len=4, overlong="split", strategy="next_fit"
    )
    # doc 1 (10 tokens) -> pieces 4, 4, 2; next-fit: [3] [4] [4] [2 2] [4] [1]
    assert plan.doc_row.tolist() == [0, 1, 1, 1, 2, 3, 4]
    assert plan.piece.tolist() == [0, 0, 1, 2, 0, 0, 0]
    assert plan.src_offset.tolist() == [0, 0, 4, 8, 0, 0, 0]
    assert plan.length.tolist() == [3, 4, 4, 2, 2, 4, 1]
    assert plan.sequence.tolist() == [0, 1, 2, 3, 3, 4, 5]
    assert plan.start.tolist() == [0, 0, 0, 0, 2, 0, 0]
    assert plan.num_sequences == 6
    assert (plan.split_documents, plan.truncated_documents, plan.dropped_tokens) == (1, 0, 0)
    assert plan.doc_row.dtype == np.int64 and plan.length.dtype == np.int32
    assert plan.sequence.dtype == np.int64 and plan.start.dtype == np.int32


def test_truncate_small_example():
    plan = plan_packing(
        np.array([3, 10, 2, 6]), seq_len=4, overlong="truncate", strategy="next_fit"
    )
    assert plan.doc_row.tolist() == [0, 1, 2, 3]
    assert plan.length.tolist() == [3, 4, 2, 4]
    assert plan.src_offset.tolist() == [0, 0, 0, 0]
    assert plan.piece.tolist() == [0, 0, 0, 0]
    assert plan.sequence.tolist() == [0, 1, 2, 3]
    assert (plan.split_documents, plan.truncated_documents, plan.dropped_tokens) == (0, 2, 8)


@pytest.mark.parametrize("overlong", ["split", "truncate"])
def test_random_plans_match_brute_force(overlong):
    for trial, seq_len, lengths in random_cases(1234):
        plan = plan_packing(lengths, seq_len, overlong, strategy="next_fit")
        assert plan_tokens(plan) == reference_pack(lengths.tolist(), seq_len, overlong), trial
        # order preserved: pieces in (document, piece) order, sequences non-decreasing
        order = list(zip(plan.doc_row.tolist(), plan.piece.tolist(), strict=True))
        assert order == sorted(order)
        assert (np.diff(plan.sequence) >= 0).all()
        assert (plan.start + plan.length <= seq_len).all()
        kept = np.minimum(lengths, seq_len) if overlong == "truncate" else lengths
        assert int(plan.length.sum()) == int(kept.sum())
        assert plan.dropped_tokens == int((lengths - kept).sum())
        over = int((lengths > seq_len).sum())
        assert plan.split_documents == (over if overlong == "split" else 0)
        assert plan.truncated_documents == (over if overlong == "truncate" else 0)


def test_best_fit_small_example():
    # pieces 3, 4, 4, 2 (doc 1 split), 2, 4, 1: the 2-token pieces fill no sequence's last
    # token at first; the 1-token piece goes to the sequence with 1 free token (doc 0's)
    plan = plan_packing(np.array([3, 10, 2, 4, 1]), seq_len=4, overlong="split")
    assert plan.sequence.tolist() == [0, 0, 1, 2, 3, 3, 4]
    assert plan.doc_row.tolist() == [0, 4, 1, 1, 1, 2, 3]
    assert plan.start.tolist() == [0, 3, 0, 0, 0, 2, 0]
    assert plan.num_sequences == 5


@pytest.mark.parametrize("overlong", ["split", "truncate"])
def test_random_best_fit_plans_place_each_piece_in_the_fullest_fitting_sequence(overlong):
    for trial, seq_len, lengths in random_cases(99):
        plan = plan_packing(lengths, seq_len, overlong)
        expected = Counter(
            t for seq in reference_pack(lengths.tolist(), seq_len, overlong) for t in seq
        )
        assert Counter(t for seq in plan_tokens(plan) for t in seq) == expected, trial
        assert (np.diff(plan.sequence) >= 0).all()
        # replay in dataset order: each piece went to a sequence with the least fitting room
        room: dict[int, int] = {}
        for i in np.lexsort((plan.piece, plan.doc_row)):
            n, seq = int(plan.length[i]), int(plan.sequence[i])
            fitting = [r for r in room.values() if r >= n]
            if seq in room:
                assert room[seq] == min(fitting), trial
                assert plan.start[i] == seq_len - room[seq]
            else:
                assert not fitting and seq == len(room), trial
                room[seq] = seq_len
                assert plan.start[i] == 0
            room[seq] -= n
        assert plan.num_sequences == len(room)
        next_fit = plan_packing(lengths, seq_len, overlong, strategy="next_fit")
        assert plan.num_sequences <= next_fit.num_sequences


def test_shards_cover_every_piece_once():
    plan = plan_packing(np.arange(1, 200) % 17 + 1, seq_len=32, overlong="split")
    per_shard = 5
    shards = [shard_pieces(plan, i, per_shard) for i in range(num_shards(plan, per_shard))]
    assert num_shards(plan, per_shard) == -(-plan.num_sequences // per_shard)
    assert np.concatenate(shards).tolist() == list(range(plan.num_pieces))
    for i, idx in enumerate(shards):
        assert len(idx) > 0
        assert (plan.sequence[idx] // per_shard == i).all()
    with pytest.raises(ValueError, match="outside"):
        shard_pieces(plan, len(shards), per_shard)


def test_empty_and_bad_arguments():
    plan = plan_packing(np.array([], dtype=np.int64), seq_len=8, overlong="split")
    assert plan.num_sequences == 0 and plan.num_pieces == 0
    assert num_shards(plan, 4) == 0
    with pytest.raises(ValueError, match="overlong"):
        plan_packing(np.array([3]), seq_len=8, overlong="drop")
    with pytest.raises(ValueError, match="strategy"):
        plan_packing(np.array([3]), seq_len=8, overlong="split", strategy="first_fit")


def test_many_documents_every_token_once_with_little_padding():
    lengths = np.random.default_rng(0).integers(1, 6000, size=100_000)
    plan = plan_packing(lengths, seq_len=3072, overlong="split")
    assert plan.length.sum() == lengths.sum()
    assert (plan.start + plan.length <= 3072).all()
    padding = plan.num_sequences * 3072 / lengths.sum() - 1
    assert padding < 0.02, padding


def test_padding_hint_names_the_seq_len_that_fills_sequences() -> None:
    """`dflash generate`'s text rows all have one length: 640-token documents fill a 3,072-token
    sequence with 4 and 512 tokens of padding each (the pystd recipe's store: 16% padding)."""
    lengths = np.full(1000, 640)
    plan = plan_packing(lengths, 3072, "split")
    assert padding_share(plan) == pytest.approx(1 - 4 * 640 / 3072)
    hint = padding_hint(lengths, plan, "split", "best_fit")
    assert hint is not None and "100% of the documents are 640 tokens" in hint
    assert "holds 4 of them" in hint and "--set packing.seq_len=3200 would pad 0.0%" in hint
    # the hint's seq_len does what it says
    assert padding_share(plan_packing(lengths, 3200, "split")) == 0.0


def test_no_padding_hint_without_a_gain() -> None:
    mixed = np.random.default_rng(0).integers(200, 4000, 2000)  # best-fit packs these well
    assert padding_hint(mixed, plan_packing(mixed, 3072, "split"), "split", "best_fit") is None
    low = np.full(100, 1000)  # 3 x 1,000 in 3,072: 2.3% padding, under the 5% worth a line
    assert padding_hint(low, plan_packing(low, 3072, "split"), "split", "best_fit") is None
