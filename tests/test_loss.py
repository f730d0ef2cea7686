"""The chunked LM-head loss against an unchunked reference; its memory bound; its stats.

Legend: A anchors, B slots, Q = A*B rows, D hidden, V vocabulary, k top-k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from stage2_train.anchors import slot_weights
from stage2_train.loss import chunked_block_loss

A, B, D, V, TOPK = 6, 8, 12, 300, 5


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden_QD = torch.randn(A * B, D, generator=g, dtype=torch.float64)
    head_VD = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    labels_AB = torch.randint(0, V, (A, B), generator=g)
    mask_AB = torch.rand(A, B, generator=g) > 0.3
    mask_AB[:, 0] = False
    labels_AB[~mask_AB] = -100  # garbage where not counted
    weights_AB = slot_weights(B)[None, :].double() * mask_AB
    logits = torch.randn(A * B, V, generator=g, dtype=torch.float64) * 3
    top = logits.topk(TOPK, dim=-1)
    topk_lp = top.values - logits.logsumexp(-1, keepdim=True)
    return hidden_QD, head_VD, labels_AB, weights_AB, top.indices, topk_lp


def reference(hidden_QD, head_VD, labels_AB, weights_AB, topk_ids, topk_lp, lam, temp):
    logits_QV = (hidden_QD @ head_VD.T).double()
    w_Q = weights_AB.reshape(-1).double()
    lab = labels_AB.reshape(-1).clamp(min=0)
    ce_Q = F.cross_entropy(logits_QV, lab, reduction="none")
    p = torch.softmax(topk_lp / temp, -1)
    log_q = torch.log_softmax(logits_QV / temp, -1).gather(1, topk_ids)
    kl_Q = (p * (p.log() - log_q)).sum(-1) * temp**2
    return ((w_Q * ce_Q).sum() + lam * (w_Q * kl_Q).sum()) / w_Q.sum(), logits_QV


@pytest.mark.parametrize("chunk", [7, 16, 48, 1000])
@pytest.mark.parametrize("lam,temp", [(0.0, 1.0), (0.5, 2.0)])
def test_equals_unchunked_reference(chunk: int, lam: float, temp: float) -> None:
    h, head, labels, weights, tid, tlp = inputs()
    h1 = h.clone().requires_grad_()
    h2 = h.clone().requires_grad_()
    loss, stats = chunked_block_loss(h1, head, labels, weights, chunk, tid, tlp, lam, temp)
    ref, logits = reference(h2, head, labels, weights, tid, tlp, lam, temp)
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert stats["weight_sum"].item() == pytest.approx(weights.sum().item())
    counted = weights > 0
    correct = (logits.argmax(-1).view(A, B) == labels) & counted
    assert stats["correct_B"].tolist() == correct.sum(0).tolist()
    assert stats["total_B"].tolist() == counted.sum(0).tolist()
    assert stats["total_B"][0] == 0


def test_distillation_is_zero_when_drafter_matches_renormalised_topk() -> None:
    # Head = identity on a V = D vocabulary: logits = hidden. Put all mass on the top-k ids.
    q_rows, vocab = 4, 6
    head = torch.eye(vocab, dtype=torch.float64)
    tid = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4]])
    tlp = torch.log(torch.tensor([[0.3, 0.1], [0.2, 0.2], [0.5, 0.25], [0.05, 0.15]])).double()
    renorm = torch.softmax(tlp, -1)
    hidden = torch.full((q_rows, vocab), -1e4, dtype=torch.float64)
    hidden.scatter_(1, tid, renorm.log())
    w = torch.ones(q_rows, dtype=torch.float64)
    labels = tid[:, 0]
    loss_kl, stats = chunked_block_loss(hidden, head, labels, w, 3, tid, tlp, 1.0, 1.0)
    assert stats["distill_sum"].abs().item() < 1e-6
    # A mismatched drafter pays a positive KL.
    _, stats = chunked_block_loss(torch.zeros_like(hidden), head, labels, w, 3, tid, tlp, 1.0)
    assert stats["distill_sum"].item() > 0.1


class MaxNumel(TorchDispatchMode):
    """Largest tensor any op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_peak_is_one_chunk_of_logits() -> None:
    h, head, labels, weights, tid, tlp = inputs()
    head = head[:, :4].contiguous()  # V x 4: smaller than one chunk of logits
    h = h[:, :4].clone().requires_grad_()
    chunk = 8
    with MaxNumel() as probe:
        loss, _ = chunked_block_loss(h, head, labels, weights, chunk, tid, tlp, 0.5, 1.0)
        loss.backward()
    assert probe.max_numel == chunk * V, (probe.max_numel, chunk * V, A * B * V)


def test_flat_labels_and_empty_weights() -> None:
    h, head, labels, weights, _, _ = inputs()
    loss, stats = chunked_block_loss(h, head, labels.flatten(), torch.zeros(A * B), 16)
    assert loss.item() == 0.0 and stats["total_B"].tolist() == [0]
    loss, stats = chunked_block_loss(h, head, labels.flatten(), weights.flatten(), 16)
    assert stats["total_B"].numel() == 1


def test_head_gradient_and_no_grad_path() -> None:
    h, head, labels, weights, tid, tlp = inputs(1)
    h1, w1 = h.clone().requires_grad_(), head.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), head.clone().requires_grad_()
    loss, _ = chunked_block_loss(h1, w1, labels, weights, 10, tid, tlp, 0.3, 1.5)
    ref, _ = reference(h2, w2, labels, weights, tid, tlp, 0.3, 1.5)
    (2 * loss).backward()
    (2 * ref).backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        again, _ = chunked_block_loss(h, head, labels, weights, 10, tid, tlp, 0.3, 1.5)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def dpace_reference(ce_AB, counted_AB, alpha):
    """D-PACE multipliers written out slot by slot, as the paper states them."""
    out = torch.zeros_like(ce_AB)
    for a in range(ce_AB.size(0)):
        q = [
            (1 - alpha) * float(torch.exp(-ce_AB[a, j])) + alpha if counted_AB[a, j] else 1.0
            for j in range(ce_AB.size(1))
        ]
        reach = [1.0] * len(q)
        for m in range(len(q)):
            reach[m] = q[m] * (reach[m - 1] if m else 1.0)
        for i in range(len(q)):
            out[a, i] = sum(reach[i:])
    return out


@pytest.mark.parametrize("chunk", [5, 16, 1000])
@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_dpace_weights_and_gradient_match_a_dense_reference(chunk: int, lam: float) -> None:
    h, head, labels, weights, tid, tlp = inputs(3)
    h1 = h.clone().requires_grad_()
    h2 = h.clone().requires_grad_()
    loss, stats = chunked_block_loss(h1, head, labels, weights, chunk, tid, tlp, lam, 1.0, 0.5)
    logits_QV = (h2 @ head.T).double()
    ce_AB = F.cross_entropy(logits_QV, labels.reshape(-1).clamp(min=0), reduction="none")
    ce_AB = ce_AB.view(A, B)
    factor_AB = dpace_reference(ce_AB.detach(), weights > 0, 0.5)
    assert factor_AB[:, 1].min() > factor_AB[:, -1].max() - 1e-9  # early slots weigh more
    p = torch.softmax(tlp, -1)
    kl_AB = (p * (p.log() - torch.log_softmax(logits_QV, -1).gather(1, tid))).sum(-1).view(A, B)
    w_AB = weights * factor_AB
    ref = ((w_AB * ce_AB).sum() + lam * (w_AB * kl_AB).sum()) / weights.sum()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    # the stats keep the static weights, comparable with a run without D-PACE
    plain = (weights * ce_AB.detach()).sum()
    assert stats["ce_sum"].item() == pytest.approx(plain.item(), rel=1e-6)
    plain_kl = (weights * kl_AB.detach()).sum() if lam > 0 else torch.zeros(())
    assert stats["distill_sum"].item() == pytest.approx(plain_kl.item(), rel=1e-5, abs=1e-9)
