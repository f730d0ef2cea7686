"""Anchor sampling, labels, positions and slot weights against loop-built expectations.

Legend: S sequence tokens, A anchors, B block size.
"""

from __future__ import annotations

import math

import pytest
import torch

from stage2_train.anchors import (
    block_gather,
    block_labels,
    block_positions,
    default_gamma,
    eligible_anchors,
    next_token_source,
    pad_anchors,
    sample_anchors,
    slot_weights,
)


def make_sequence(lengths: list[int], pad: int, seed: int = 0):
    """Packed tokens, loss mask (prompt/response runs), doc ids (-1 pad), positions."""
    g = torch.Generator().manual_seed(seed)
    docs, pos, mask = [], [], []
    for d, n in enumerate(lengths):
        docs += [d] * n
        pos += list(range(n))
        prompt = n // 3
        mask += [0] * prompt + [1] * (n - prompt)
    docs += [-1] * pad
    pos += [0] * pad
    mask += [0] * pad
    tokens = torch.randint(5, 1000, (len(docs),), generator=g)
    return tokens, torch.tensor(mask, dtype=torch.uint8), torch.tensor(docs), torch.tensor(pos)


def expected_eligible(mask: list[int], docs: list[int]) -> list[int]:
    return [
        p
        for p in range(len(docs) - 1)
        if mask[p] and mask[p + 1] and docs[p] == docs[p + 1] and docs[p] >= 0
    ]


def test_eligible_positions() -> None:
    _, mask, docs, _ = make_sequence([10, 7, 5], pad=3)
    mask[12] = 0  # a hole inside a response
    got = eligible_anchors(mask, docs).nonzero().flatten().tolist()
    assert got == expected_eligible(mask.tolist(), docs.tolist())
    assert 9 not in got  # last token of a document: its block has no label


@pytest.mark.parametrize("per_document", [False, True])
def test_sample_anchors_subset_sorted_unique(per_document: bool) -> None:
    _, mask, docs, _ = make_sequence([40, 9, 120, 6], pad=5)
    eligible = set(expected_eligible(mask.tolist(), docs.tolist()))
    for budget in (1, 3, 17, 60, 500):
        g = torch.Generator().manual_seed(budget)
        a = sample_anchors(mask, docs, budget, g, per_document=per_document)
        assert a.dtype == torch.int64
        assert a.numel() == min(budget, len(eligible))
        assert a.tolist() == sorted(set(a.tolist()))
        assert set(a.tolist()) <= eligible
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(
        sample_anchors(mask, docs, 20, g1, per_document),
        sample_anchors(mask, docs, 20, g2, per_document),
    )


def test_per_document_budget_is_proportional_with_one_each() -> None:
    lengths = [300, 12, 60, 9]
    _, mask, docs, _ = make_sequence(lengths, pad=0)
    elig = expected_eligible(mask.tolist(), docs.tolist())
    counts = [sum(docs[p].item() == d for p in elig) for d in range(len(lengths))]
    budget = 40
    a = sample_anchors(mask, docs, budget, torch.Generator().manual_seed(0), per_document=True)
    per_doc = [int((docs[a] == d).sum()) for d in range(len(lengths))]
    assert sum(per_doc) == budget and min(per_doc) >= 1
    spare = [c - 1 for c in counts]
    for d in range(len(lengths)):
        quota = 1 + (budget - len(lengths)) * spare[d] / sum(spare)
        assert abs(per_doc[d] - quota) < 1
    # A budget smaller than the documents: one anchor each for `budget` documents.
    a = sample_anchors(mask, docs, 3, torch.Generator().manual_seed(0), per_document=True)
    assert len(set(docs[a].tolist())) == 3


def expected_labels(anchors, source, mask, docs, bsz):
    labels, weights = [], []
    for p in anchors:
        row_l, row_w = [], []
        for k in range(bsz):
            t = p + k
            ok = p >= 0 and k >= 1 and t < len(docs) and docs[t] == docs[p] and mask[t] == 1
            row_l.append(source[t] if ok else None)
            row_w.append(ok)
        labels.append(row_l)
        weights.append(row_w)
    return labels, weights


def test_block_labels_match_definition() -> None:
    tokens, mask, docs, _ = make_sequence([20, 11, 6], pad=4)
    mask[25] = 0
    anchors = pad_anchors(torch.tensor([7, 8, 9, 18, 21, 29, 35]), 9)  # close, ends, pads
    bsz = 8
    labels_AB, weight_AB = block_labels(anchors, tokens, mask, docs, None, bsz)
    exp_l, exp_w = expected_labels(
        anchors.tolist(), tokens.tolist(), mask.tolist(), docs.tolist(), bsz
    )
    assert weight_AB.dtype == torch.bool and labels_AB.dtype == torch.int64
    assert weight_AB.tolist() == exp_w
    for a in range(anchors.numel()):
        for k in range(bsz):
            if exp_w[a][k]:
                assert labels_AB[a, k] == exp_l[a][k]
    assert not weight_AB[:, 0].any(), "slot 0 carries no loss"
    assert not weight_AB[-2:].any(), "padding anchors carry no loss"


def test_label_shift_data_vs_perfect_argmax() -> None:
    # A perfect target predicts token t + 1 at t; its argmax labels must equal the data labels.
    tokens, mask, docs, _ = make_sequence([30, 25], pad=3)
    argmax = torch.cat([tokens[1:], tokens[:1]])  # stored target_argmax[t] = tokens[t + 1]
    anchors = torch.tensor([12, 13, 40, 50])
    data_l, data_w = block_labels(anchors, tokens, mask, docs, None, 6)
    arg_l, arg_w = block_labels(anchors, tokens, mask, docs, next_token_source(argmax), 6)
    assert torch.equal(data_w, arg_w)
    assert torch.equal(data_l[data_w], arg_l[arg_w])
    assert data_l[0, 1] == tokens[13], "slot k of anchor p predicts the token at p + k"
    # The same shift for top-k rows: the row used for slot k is the one stored at p + k - 1.
    topk_SX = torch.arange(len(tokens))[:, None].repeat(1, 3)
    rows = block_gather(anchors, next_token_source(topk_SX), 6)
    assert rows[1, 2].tolist() == [13 + 2 - 1] * 3


def test_block_positions_and_padding() -> None:
    _, _, _, pos = make_sequence([10, 10], pad=2)
    anchors = pad_anchors(torch.tensor([3, 12]), 3)
    assert anchors.tolist() == [3, 12, -1]
    got = block_positions(anchors, pos, 4).tolist()
    assert got == [3, 4, 5, 6, 2, 3, 4, 5, 0, 1, 2, 3]  # document-relative: 12 -> 2


def test_slot_weights_formula() -> None:
    for bsz, gamma in ((16, 7.0), (10, 5.0), (8, 4.0), (32, 14.0)):
        assert default_gamma(bsz) == gamma
        w = slot_weights(bsz)
        assert w[0] == 0 and w[1] == 1
        for k in range(1, bsz):
            assert w[k].item() == pytest.approx(math.exp(-(k - 1) / gamma), rel=1e-6)
    assert slot_weights(4, gamma=2.0).tolist() == pytest.approx(
        [0, 1, math.exp(-0.5), math.exp(-1)]
    )
