"""Slot-weighted CE (+ optional top-k distillation) through the frozen LM head, in chunks.

The full logits (Q x V fp32: 5 GB at 8,192 x 151,936) are never materialised. Each chunk of
``chunk_tokens`` rows computes its logits, its loss terms AND their gradient with respect to
the hidden states right away (softmax minus target, times the weight, times the head), then
drops the logits: peak memory is about chunk_tokens x V x 3 fp32-sized buffers, whatever Q.
Backward only scales the stored [Q, D] gradient by the incoming one. Compared with
activation checkpointing (recompute the chunk in backward) this saves one LM-head matmul
and the autograd temporaries of the softmax: on an H200 at 8,192 x 151,936 the checkpointed
form took 82 ms per fwd+bwd, most of a 190 ms drafter step.

Loss = (sum_q w_q CE_q + distill_weight * sum_q w_q KL_q) / sum_q w_q, where w_q is the slot
weight times the label mask (anchors.slot_weights, anchors.block_labels), so slot 0 and
masked slots weigh 0. CE uses temperature 1 against the labels (data tokens or the target's
argmax). The distillation term compares the stored target top-k with the drafter:
p = softmax(topk_logprobs / T) RENORMALISED over the k stored ids (the remainder mass is
dropped: it is unknown per id), q = the drafter's full-vocabulary softmax(logits / T)
gathered at those ids, KL_q = T^2 * sum_k p_k (log p_k - log q_k). It is >= 0 and 0 only when
the drafter puts all its mass on the k ids in the target's proportions; its logit gradient is
T * w_q * (softmax(logits / T) - p scattered to the k ids).

D-PACE weighting (``dpace_alpha`` > 0, arXiv 2605.18810): each labelled slot's weight is
further multiplied, per block, by sum_{m >= i} prod_{j <= m} q'_j with q'_j = (1 - a) exp(-CE_j)
+ a (detached; slots without a label count as q' = 1): the expected share of accepted runs
that reach slot i, so early slots that gate the rest weigh more, adaptively. Chunks then hold
whole blocks. The reported ``ce_sum`` keeps the static weights, so losses stay comparable.

``loss.compile_chunks`` runs each chunk's logits and elementwise math (fp32 cast, log-sum-exp,
gathers, argmax, softmax minus target, weights, cast) as one torch.compile region, so inductor
fuses the ~8-10 passes over the [C, V] logits that eager makes into a few kernels (one on the
CPU); inductor calls cuBLAS for the logits' matmul, and the gradient's two matmuls stay outside
the region. Same operations, other rounding (reduction order, exp): tests/test_loss_compiled.py.

Legend: Q query tokens (= A*B), D hidden, V vocabulary, C chunk rows, k stored top-k, B slots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def dpace_factors(ce_NB: Tensor, counted_NB: Tensor, alpha: float) -> Tensor:
    """[N, B] D-PACE multipliers of N blocks: sum over m >= i of prod_{j <= m} q'_j."""
    q_NB = torch.where(counted_NB, (1 - alpha) * torch.exp(-ce_NB) + alpha, 1.0)
    reach_NB = torch.cumprod(q_NB, dim=1)
    return reach_NB.flip(1).cumsum(1).flip(1)


def chunk_terms(
    h_CD: Tensor,
    head_VD: Tensor,
    y_C: Tensor,
    static_C: Tensor,
    ids_Ck: Tensor | None,
    topk_lp_Ck: Tensor | None,
    lam: float,
    temperature: float,
    dpace_alpha: float,
    num_slots: int,
    need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk's loss terms and logit gradient; pure (its inputs are never written).

    Returns the chunk's sums [static-weight CE, static-weight KL, loss total] (fp32), argmax
    == label [C] and, if ``need_grad``, d(total)/d(logits) in h_CD's dtype. Eager, it
    works in place on its own [C, V] fp32 buffers (today's memory bound); under torch.compile
    (``compiled_chunk_terms``) inductor fuses the elementwise passes around the matmul into a
    few kernels. Both branches do the same fp32 operations in the same order (inductor's
    reductions may sum in another).
    """
    z_CV = (h_CD @ head_VD.T).float()
    lse_C = torch.logsumexp(z_CV, dim=-1)
    ce_C = lse_C - z_CV.gather(1, y_C[:, None])[:, 0]
    w_C = static_C  # the weights of the gradient (D-PACE multiplies them below)
    if dpace_alpha > 0:  # the chunk holds whole blocks (C % B == 0)
        counted_NB = (static_C > 0).view(-1, num_slots)
        w_C = static_C * dpace_factors(ce_C.view(-1, num_slots), counted_NB, dpace_alpha).flatten()
    ce_sum, total = (static_C * ce_C).sum(), (w_C * ce_C).sum()
    kl_sum = torch.zeros_like(ce_sum)
    correct_C = z_CV.argmax(-1) == y_C
    if ids_Ck is not None:
        assert topk_lp_Ck is not None
        zt_CV = z_CV / temperature
        lset_C = torch.logsumexp(zt_CV, dim=-1)
        log_q_Ck = zt_CV.gather(1, ids_Ck) - lset_C[:, None]
        log_p_Ck = F.log_softmax(topk_lp_Ck.float() / temperature, dim=-1)
        p_Ck = log_p_Ck.exp()
        kl_C = (p_Ck * (log_p_Ck - log_q_Ck)).sum(-1) * temperature**2
        kl_sum = (static_C * kl_C).sum()
        total = total + lam * (w_C * kl_C).sum()
    sums_3 = torch.stack([ce_sum, kl_sum, total])
    if not need_grad:
        return sums_3, correct_C, None
    # d(total)/dz = w (softmax(z) - onehot) [+ lam T w (softmax(z / T) - p scattered)]
    if torch.compiler.is_compiling():
        # out of place, the one-hot as an index comparison: one fused pass to g_CV, where a
        # scatter would make inductor write the fp32 buffer out first
        e_CV = torch.exp(z_CV - lse_C[:, None])
        onehot_CV = torch.arange(z_CV.size(1), device=z_CV.device)[None] == y_C[:, None]
        g_CV = torch.where(onehot_CV, e_CV - 1, e_CV) * w_C[:, None]
        if ids_Ck is not None:
            gt_CV = torch.exp(zt_CV - lset_C[:, None]).scatter_add(1, ids_Ck, -p_Ck)
            g_CV = g_CV + gt_CV * ((lam * temperature) * w_C[:, None])
        return sums_3, correct_C, g_CV.to(h_CD.dtype)
    g_CV = z_CV.sub_(lse_C[:, None]).exp_()  # in place over this call's own logits
    g_CV.scatter_add_(1, y_C[:, None], -torch.ones_like(w_C)[:, None])
    g_CV.mul_(w_C[:, None])
    if ids_Ck is not None:
        gt_CV = zt_CV.sub_(lset_C[:, None]).exp_().scatter_add_(1, ids_Ck, -p_Ck)
        g_CV.add_(gt_CV.mul_((lam * temperature) * w_C[:, None]))
        del gt_CV, zt_CV
    return sums_3, correct_C, g_CV.to(h_CD.dtype)


@functools.cache
def compiled_chunk_terms() -> Callable[..., tuple[Tensor, Tensor, Tensor | None]]:
    """``chunk_terms`` as one inductor region (loss.compile_chunks). Static shapes: one graph
    for the full chunks and, when Q % C != 0, exactly one more for the shorter last chunk (Q
    is the same every step, so neither recompiles). fullgraph: a graph break, or Dynamo's
    recompile limit, raises instead of falling back to eager silently."""
    return torch.compile(chunk_terms, dynamic=False, fullgraph=True)


class _ChunkedHeadLoss(torch.autograd.Function):
    """(weighted CE sum + lam * weighted KL sum, CE sum, KL sum, argmax == label [Q])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_QD: Tensor,
        head_VD: Tensor,
        labels_Q: Tensor,
        weights_Q: Tensor,
        topk_ids_Qk: Tensor | None,
        topk_logprobs_Qk: Tensor | None,
        lam: float,
        temperature: float,
        chunk_tokens: int,
        num_slots: int,
        dpace_alpha: float,
        compiled: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        distill = topk_ids_Qk is not None
        terms = compiled_chunk_terms() if compiled else chunk_terms
        grad_h_QD = torch.empty_like(hidden_QD) if need_h else None
        grad_w_VD = (
            torch.zeros(head_VD.shape, dtype=torch.float32, device=head_VD.device)
            if need_w
            else None
        )
        sums_3 = torch.zeros(3, dtype=torch.float32, device=hidden_QD.device)
        correct_Q = torch.empty(labels_Q.shape, dtype=torch.bool, device=labels_Q.device)
        for start in range(0, hidden_QD.size(0), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h_CD = hidden_QD[rows]
            chunk_3, correct_C, g_CV = terms(
                h_CD, head_VD, labels_Q[rows], weights_Q[rows],
                topk_ids_Qk[rows] if distill else None,
                topk_logprobs_Qk[rows] if distill else None,
                lam, temperature, dpace_alpha, num_slots, need_h or need_w,
            )  # fmt: skip
            sums_3 += chunk_3
            correct_Q[rows] = correct_C
            if need_h:
                grad_h_QD[rows] = g_CV @ head_VD
            if need_w:
                grad_w_VD += (g_CV.T @ h_CD).float()
        ctx.head_dtype = head_VD.dtype
        ctx.save_for_backward(grad_h_QD, grad_w_VD)
        ce_sum, kl_sum, total_sum = sums_3.unbind()
        ctx.mark_non_differentiable(ce_sum, kl_sum, correct_Q)
        return total_sum, ce_sum, kl_sum, correct_Q

    @staticmethod
    def backward(ctx: Any, g_total: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        grad_h_QD, grad_w_VD = ctx.saved_tensors
        gh = grad_h_QD * g_total.to(grad_h_QD.dtype) if grad_h_QD is not None else None
        gw = (grad_w_VD * g_total).to(ctx.head_dtype) if grad_w_VD is not None else None
        return gh, gw, None, None, None, None, None, None, None, None, None, None


def chunked_block_loss(
    hidden_QD: Tensor,
    lm_head_weight_VD: Tensor,
    labels_Q: Tensor,
    weights_Q: Tensor,
    chunk_tokens: int,
    topk_ids_Qk: Tensor | None = None,
    topk_logprobs_Qk: Tensor | None = None,
    distill_weight: float = 0.0,
    temperature: float = 1.0,
    dpace_alpha: float = 0.0,
    compiled: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted block loss and its statistics.

    Args:
        hidden_QD: drafter output (after the final norm), rows = anchor-major slots.
        lm_head_weight_VD: the LM head (frozen in training; a gradient is computed if it
            requires one).
        labels_Q, weights_Q: [A, B] (per-slot statistics over B slots) or flat [Q]
            (statistics as one slot). weights = slot weight * label mask (0 = no loss).
        chunk_tokens: rows per head + loss chunk.
        topk_ids_Qk, topk_logprobs_Qk: the target's top-k ids and log-probabilities for the
            same positions as the labels (anchors.next_token_source + block_gather); ids of
            any integer dtype (the loader's are int32), widened to int64 here, on their device.
        distill_weight, temperature: weight and temperature of the KL term (0 = off).
        dpace_alpha: D-PACE smoothing a (0 = off; needs [A, B] labels). The loss to
            differentiate then carries the D-PACE multipliers; the stats do not.
        compiled: run each chunk's elementwise math as one compiled region
            (``compiled_chunk_terms``); equal to the eager path up to fp32 rounding.

    Returns:
        loss (scalar, normalised by sum of weights) and detached stats: ``ce_sum``,
        ``distill_sum``, ``weight_sum`` (to renormalise across micro-batches), ``correct_B``
        and ``total_B`` (per slot: argmax == label among slots with weight > 0).
    """
    num_slots = labels_Q.size(-1) if labels_Q.dim() == 2 else 1
    labels_Q, weights_Q = labels_Q.reshape(-1), weights_Q.reshape(-1).float()
    assert labels_Q.numel() == hidden_QD.size(0) == weights_Q.numel(), (
        hidden_QD.shape,
        labels_Q.shape,
    )
    counted_Q = weights_Q > 0
    labels_Q = torch.where(counted_Q, labels_Q.long(), 0)  # masked labels may be anything
    distill = distill_weight > 0 and topk_ids_Qk is not None and topk_logprobs_Qk is not None
    topk_ids = topk_ids_Qk.reshape(labels_Q.numel(), -1).long() if distill else None
    topk_lp = topk_logprobs_Qk.reshape(labels_Q.numel(), -1) if distill else None

    if dpace_alpha > 0:
        assert num_slots > 1, "D-PACE weighs the slots of a block: pass [A, B] labels"
        chunk_tokens = max(chunk_tokens // num_slots, 1) * num_slots  # whole blocks per chunk
    total, ce_sum, kl_sum, correct_Q = _ChunkedHeadLoss.apply(
        hidden_QD, lm_head_weight_VD, labels_Q, weights_Q, topk_ids, topk_lp,
        distill_weight if distill else 0.0, temperature, chunk_tokens, num_slots, dpace_alpha,
        compiled,
    )  # fmt: skip
    weight_sum = weights_Q.sum()
    loss = total / weight_sum.clamp(min=1e-6)
    correct_Q = correct_Q & counted_Q
    stats = {
        "ce_sum": ce_sum.detach(),
        "distill_sum": kl_sum.detach(),
        "weight_sum": weight_sum.detach(),
        "correct_B": correct_Q.view(-1, num_slots).sum(0),
        "total_B": counted_Q.view(-1, num_slots).sum(0),
    }
    return loss, stats
