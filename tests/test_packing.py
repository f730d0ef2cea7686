"""The packing plan: every token placed once, no overlap, order kept, against a brute force."""

from __future__ import annotations

import time

import numpy as np
import pytest

from stage1_extract.packing import num_shards, plan_packing, shard_pieces


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
    plan = plan_packing(np.array([3, 10, 2, 4, 1]), seq_len=4, overlong="split")
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
    plan = plan_packing(np.array([3, 10, 2, 6]), seq_len=4, overlong="truncate")
    assert plan.doc_row.tolist() == [0, 1, 2, 3]
    assert plan.length.tolist() == [3, 4, 2, 4]
    assert plan.src_offset.tolist() == [0, 0, 0, 0]
    assert plan.piece.tolist() == [0, 0, 0, 0]
    assert plan.sequence.tolist() == [0, 1, 2, 3]
    assert (plan.split_documents, plan.truncated_documents, plan.dropped_tokens) == (0, 2, 8)


@pytest.mark.parametrize("overlong", ["split", "truncate"])
def test_random_plans_match_brute_force(overlong):
    rng = np.random.default_rng(1234)
    for trial in range(150):
        seq_len = int(rng.integers(1, 40))
        lengths = rng.integers(1, 3 * seq_len + 2, size=int(rng.integers(0, 30)))
        plan = plan_packing(lengths, seq_len, overlong)
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


def test_one_million_documents_is_fast():
    lengths = np.random.default_rng(0).integers(1, 6000, size=1_000_000)
    t0 = time.perf_counter()
    plan = plan_packing(lengths, seq_len=3072, overlong="split")
    elapsed = time.perf_counter() - t0
    assert plan.length.sum() == lengths.sum()
    assert elapsed < 5.0, f"planning 1M documents took {elapsed:.2f} s"
