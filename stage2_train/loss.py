"""Slot-weighted CE (+ optional top-k distillation) through the frozen LM head, in chunks.

The full logits (Q x V fp32: 5 GB at 8,192 x 151,936) are never materialised: each chunk of
``chunk_tokens`` rows runs head + loss under activation checkpointing, so the forward keeps
only per-chunk scalars and the backward recomputes one chunk's logits at a time. Peak memory
is about chunk_tokens x V x (a few fp32 copies), whatever Q.

Loss = (sum_q w_q CE_q + distill_weight * sum_q w_q KL_q) / sum_q w_q, where w_q is the slot
weight times the label mask (anchors.slot_weights, anchors.block_labels), so slot 0 and
masked slots weigh 0. CE uses temperature 1 against the labels (data tokens or the target's
argmax). The distillation term compares the stored target top-k with the drafter:
p = softmax(topk_logprobs / T) RENORMALISED over the k stored ids (the remainder mass is
dropped: it is unknown per id), q = the drafter's full-vocabulary softmax(logits / T)
gathered at those ids, KL_q = T^2 * sum_k p_k (log p_k - log q_k). It is >= 0 and 0 only when
the drafter puts all its mass on the k ids in the target's proportions.

Legend: Q query tokens (= A*B), D hidden, V vocabulary, C chunk rows, k stored top-k, B slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk_terms(
    hidden_CD: Tensor,
    head_VD: Tensor,
    labels_C: Tensor,
    weights_C: Tensor,
    topk_ids_Ck: Tensor | None,
    topk_logprobs_Ck: Tensor | None,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(weighted CE sum, weighted KL sum, argmax == label [C]) of one chunk."""
    logits_CV = (hidden_CD @ head_VD.T).float()
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    ce_C = lse_C - logits_CV.gather(1, labels_C[:, None])[:, 0]
    ce_sum = (weights_C * ce_C).sum()
    kl_sum = ce_sum.new_zeros(())
    if topk_ids_Ck is not None and topk_logprobs_Ck is not None:
        scaled_CV = logits_CV / temperature
        log_q_Ck = scaled_CV.gather(1, topk_ids_Ck) - torch.logsumexp(scaled_CV, dim=-1)[:, None]
        log_p_Ck = F.log_softmax(topk_logprobs_Ck.float() / temperature, dim=-1)
        kl_C = (log_p_Ck.exp() * (log_p_Ck - log_q_Ck)).sum(-1) * temperature**2
        kl_sum = (weights_C * kl_C).sum()
    correct_C = logits_CV.detach().argmax(-1) == labels_C
    return ce_sum, kl_sum, correct_C


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted block loss and its statistics.

    Args:
        hidden_QD: drafter output (after the final norm), rows = anchor-major slots.
        lm_head_weight_VD: the frozen LM head.
        labels_Q, weights_Q: [A, B] (per-slot statistics over B slots) or flat [Q]
            (statistics as one slot). weights = slot weight * label mask (0 = no loss).
        chunk_tokens: rows per head + loss chunk.
        topk_ids_Qk, topk_logprobs_Qk: the target's top-k ids and log-probabilities for the
            same positions as the labels (anchors.next_token_source + block_gather).
        distill_weight, temperature: weight and temperature of the KL term (0 = off).

    Returns:
        loss (scalar, normalised by sum of weights) and detached stats: ``ce_sum``,
        ``distill_sum``, ``weight_sum`` (to renormalise across micro-batches), ``correct_B``
        and ``total_B`` (per slot: argmax == label among slots with weight > 0).
    """
    num_slots = labels_Q.size(-1) if labels_Q.dim() == 2 else 1
    labels_Q, weights_Q = labels_Q.reshape(-1), weights_Q.reshape(-1).float()
    n_q = hidden_QD.size(0)
    assert labels_Q.numel() == n_q == weights_Q.numel(), (hidden_QD.shape, labels_Q.shape)
    counted_Q = weights_Q > 0
    labels_Q = torch.where(counted_Q, labels_Q.long(), 0)  # masked labels may be anything
    distill = distill_weight > 0 and topk_ids_Qk is not None and topk_logprobs_Qk is not None

    ce_sum = hidden_QD.new_zeros((), dtype=torch.float32)
    kl_sum = ce_sum.clone()
    correct_parts = []
    for start in range(0, n_q, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        extra = (topk_ids_Qk[rows].long(), topk_logprobs_Qk[rows]) if distill else (None, None)
        ce_c, kl_c, correct_c = checkpoint(
            _chunk_terms,
            hidden_QD[rows],
            lm_head_weight_VD,
            labels_Q[rows],
            weights_Q[rows],
            *extra,
            temperature,
            use_reentrant=False,
        )
        ce_sum = ce_sum + ce_c
        kl_sum = kl_sum + kl_c
        correct_parts.append(correct_c)

    weight_sum = weights_Q.sum()
    loss = (ce_sum + distill_weight * kl_sum) / weight_sum.clamp(min=1e-6)
    correct_Q = torch.cat(correct_parts) & counted_Q
    stats = {
        "ce_sum": ce_sum.detach(),
        "distill_sum": kl_sum.detach(),
        "weight_sum": weight_sum.detach(),
        "correct_B": correct_Q.view(-1, num_slots).sum(0),
        "total_B": counted_Q.view(-1, num_slots).sum(0),
    }
    return loss, stats
