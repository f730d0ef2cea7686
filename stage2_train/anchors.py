"""Anchor sampling, block labels, block positions and slot weights of one packed sequence.

An anchor ``p`` opens a block of B slots: slot 0 holds tokens[p] (at inference, the last
accepted token), slot k >= 1 is trained to predict the token at ``p + k`` and sits at RoPE
position ``position_ids[p] + k`` (document-relative).

Labels come from a per-position ``label_source_S`` where index t holds the label OF POSITION
t (the token the model should put there):
- ``data`` target: ``tokens_S`` itself;
- ``argmax`` target: ``next_token_source(target_argmax_S)``, because the stored
  target_argmax[t] is the target's prediction of token t + 1 (FORMAT.md): the label of
  position t is target_argmax[t - 1]. The same shift applies to the stored top-k rows.
Forgetting that shift (or applying it twice) is the "labels shifted by one" bug.

Fixed shapes: ``pad_anchors`` pads to the budget with -1; every function here treats a -1
anchor as an empty block (no labels, mask token inputs, own-block attention only).

Legend: S sequence tokens, A anchors, B block size, X any trailing dims.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's values


def eligible_anchors(loss_mask_S: Tensor, document_ids_S: Tensor) -> Tensor:
    """[S] bool: p is a response token and so is p + 1, in the same document.

    Requiring loss_mask[p + 1] (not only the same document) drops anchors whose block would
    carry no label at slot 1, e.g. the end-of-turn token followed by an unsupervised newline.
    """
    ok_S = torch.zeros_like(loss_mask_S, dtype=torch.bool)
    ok_S[:-1] = (
        (loss_mask_S[:-1] != 0)
        & (loss_mask_S[1:] != 0)
        & (document_ids_S[1:] == document_ids_S[:-1])
        & (document_ids_S[:-1] >= 0)
    )
    return ok_S


def _per_document_budget(counts_D: Tensor, budget: int, generator: torch.Generator) -> Tensor:
    """Split ``budget`` over documents: >= 1 each while it lasts, the rest by eligible count."""
    take_D = torch.zeros_like(counts_D)
    has_D = (counts_D > 0).nonzero().flatten()
    if budget < has_D.numel():  # cannot give every document one: a random subset gets one
        take_D[has_D[torch.randperm(has_D.numel(), generator=generator)[:budget]]] = 1
        return take_D
    take_D[has_D] = 1
    spare_D = counts_D - take_D
    rest = budget - has_D.numel()
    # Integer quotas (exact): floor(spare * rest / total) each, then the largest remainders.
    # A document with a nonzero remainder has spare capacity left, so no one exceeds its count.
    total = max(int(spare_D.sum()), 1)
    take_D += spare_D * rest // total
    left = budget - int(take_D.sum())
    order = torch.argsort(spare_D * rest % total, descending=True, stable=True)
    take_D[order[:left]] += 1
    return take_D


def sample_anchors(
    loss_mask_S: Tensor,
    document_ids_S: Tensor,
    num_anchors: int,
    generator: torch.Generator,
    per_document: bool = False,
) -> Tensor:
    """Sorted anchors (int64, on CPU), sampled without replacement among eligible positions.

    Returns min(num_anchors, eligible) anchors. ``per_document`` splits the budget across
    documents: every document with an eligible position gets one while the budget lasts,
    the rest in proportion to the documents' remaining eligible positions (largest
    remainder), so short conversations are not starved by long ones.
    """
    ok_S = eligible_anchors(loss_mask_S.cpu(), document_ids_S.cpu())
    cand = ok_S.nonzero().flatten()
    if cand.numel() <= num_anchors:
        return cand
    if not per_document:
        pick = torch.randperm(cand.numel(), generator=generator)[:num_anchors]
        return cand[pick].sort().values
    docs = document_ids_S.cpu()[cand]
    _, doc_index, counts_D = torch.unique_consecutive(docs, return_inverse=True, return_counts=True)
    take_D = _per_document_budget(counts_D, num_anchors, generator)
    # Random key per candidate; within each document keep the take_D smallest keys.
    keys = torch.rand(cand.numel(), generator=generator, dtype=torch.float64) + doc_index
    order = torch.argsort(keys)  # grouped by document, random within it
    rank = torch.arange(cand.numel()) - (counts_D.cumsum(0) - counts_D)[doc_index[order]]
    chosen = order[rank < take_D[doc_index[order]]]
    return cand[chosen].sort().values


def pad_anchors(anchors_A: Tensor, num_anchors: int) -> Tensor:
    """Pad with -1 to exactly num_anchors, so every step has the same shapes (no recompile)."""
    assert anchors_A.numel() <= num_anchors, (anchors_A.numel(), num_anchors)
    pad = anchors_A.new_full((num_anchors - anchors_A.numel(),), -1)
    return torch.cat([anchors_A, pad])


def next_token_source(verifier_SX: Tensor) -> Tensor:
    """Shift verifier rows (argmax, top-k...) so index t holds the prediction OF token t.

    Row 0 (no prediction of the first token) repeats row 0; it is never a label because a
    label position p + k (k >= 1) always has its predecessor in the same document.
    """
    return torch.cat([verifier_SX[:1], verifier_SX[:-1]])


def block_gather(anchors_A: Tensor, source_SX: Tensor, block_size: int) -> Tensor:
    """[A, B, X...]: source[p + k] for every slot k (clamped at the sequence end)."""
    pos_AB = anchors_A.clamp(min=0)[:, None] + torch.arange(block_size, device=anchors_A.device)
    return source_SX[pos_AB.clamp(max=source_SX.size(0) - 1)]


def next_token_gather(
    anchors_A: Tensor, verifier_SX: Tensor, block_size: int, out: Tensor | None = None
) -> Tensor:
    """``block_gather(anchors_A, next_token_source(verifier_SX), block_size)`` without the
    shifted copy (slot k of anchor p reads row max(min(p + k, S - 1) - 1, 0)), written into
    `out` ([A, B, X...] of verifier_SX's dtype, contiguous) when given."""
    pos_AB = anchors_A.clamp(min=0)[:, None] + torch.arange(block_size, device=anchors_A.device)
    row_AB = (pos_AB.clamp(max=verifier_SX.size(0) - 1) - 1).clamp(min=0)
    trailing = verifier_SX.shape[1:]
    flat = None if out is None else out.view(-1, *trailing)
    gathered = torch.index_select(verifier_SX, 0, row_AB.flatten(), out=flat)
    return gathered.view(*row_AB.shape, *trailing)


def block_labels(
    anchors_A: Tensor,
    tokens_S: Tensor,
    loss_mask_S: Tensor,
    document_ids_S: Tensor,
    label_source_S: Tensor | None,
    block_size: int,
) -> tuple[Tensor, Tensor]:
    """(labels_AB int64, weight_mask_AB bool) of every block slot.

    labels[a, k] = label_source[p + k] (tokens when label_source is None). A slot counts only
    if k >= 1, p + k < S, p + k is in p's document, loss_mask[p + k] == 1 and p is not padding.
    """
    source_S = tokens_S if label_source_S is None else label_source_S
    n = tokens_S.numel()
    k_B = torch.arange(block_size, device=anchors_A.device)
    pos_AB = anchors_A[:, None] + k_B
    safe_AB = pos_AB.clamp(0, n - 1)
    labels_AB = source_S[safe_AB].long()
    same_doc_AB = document_ids_S[safe_AB] == document_ids_S[anchors_A.clamp(min=0)][:, None]
    mask_AB = (
        (k_B >= 1)[None, :]
        & (anchors_A >= 0)[:, None]
        & (pos_AB < n)
        & same_doc_AB
        & (loss_mask_S[safe_AB] != 0)
    )
    return labels_AB, mask_AB


def block_positions(anchors_A: Tensor, position_ids_S: Tensor, block_size: int) -> Tensor:
    """[A * B] RoPE positions: slot j of anchor p at position_ids[p] + j (padding: j)."""
    start_A = torch.where(anchors_A >= 0, position_ids_S[anchors_A.clamp(min=0)], 0)
    return (start_A.long()[:, None] + torch.arange(block_size, device=anchors_A.device)).flatten()


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B = 16/10/8; otherwise 7 * B / 16 (B = 16's ratio)."""
    return _DEFAULT_GAMMA.get(block_size, 7.0 * block_size / 16)


def training_slot_weights(block_size: int, weighting: str, gamma: float | None) -> Tensor:
    """[B] static slot weights of training: the decay, or 1 for k >= 1 under D-PACE (whose
    adaptive multipliers are applied inside the loss)."""
    if weighting == "dpace":
        return (torch.arange(block_size) >= 1).float()
    return slot_weights(block_size, gamma)


def slot_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """[B] float32: w_0 = 0, w_k = exp(-(k - 1) / gamma) for k >= 1."""
    g = default_gamma(block_size) if gamma is None else gamma
    w_B = torch.tensor([0.0] + [math.exp(-(k - 1) / g) for k in range(1, block_size)])
    return w_B.float()
