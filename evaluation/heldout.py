"""Held-out evaluation: per-slot accuracy against the stored target argmax and the implied tau.

Greedy verification accepts the longest prefix of drafted slots 1..B-1 that equals the target's
argmax, then adds the target's own token. For every held-out block we count that accepted run
exactly (stop at the first miss, or at the first slot without a label: document end or
non-response token), so `tau = mean accepted + 1` is the offline estimate of the acceptance
length. Reported besides:
- `acc`: marginal accuracy of each slot k = 1..B-1 (every labelled slot counts);
- `acc_cond`: accuracy of slot k among blocks whose slots 1..k-1 were all accepted;
- `tau_marginal`: 1 + sum_k prod_{j<=k} acc_j, what tau would be if slots erred independently
  (the gap to `tau` shows how correlated the misses are).
Counts are summed over ranks with all_reduce, so the numbers do not depend on the world size.

Legend: A anchors (blocks), B block size, Q = A*B query tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from stage2_train.data import Batch
from stage2_train.step import FrozenHead, forward_batch, greedy_predictions


def block_acceptance(correct_AB: torch.Tensor, valid_AB: torch.Tensor) -> torch.Tensor:
    """Accepted drafted tokens per block: leading slots 1.. that are labelled and correct."""
    ok_AB = (correct_AB & valid_AB)[:, 1:]
    return ok_AB.long().cumprod(dim=1).sum(dim=1)


def summarize(counts: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Turn summed counts into the reported metrics (slot lists cover slots 1..B-1)."""
    valid_B = counts["valid"].double()
    acc = (counts["correct"].double() / valid_B.clamp(min=1))[1:]
    accepted_N = counts["accepted_hist"].double()  # blocks with exactly n accepted, n = 0..B-1
    reached = accepted_N.flip(0).cumsum(0).flip(0)  # blocks with >= n accepted
    acc_cond = (reached[1:] / reached[:-1].clamp(min=1)).tolist()
    blocks = float(counts["blocks"])
    tau = 1.0 + float((accepted_N * torch.arange(len(accepted_N))).sum()) / max(blocks, 1.0)
    tau_marginal = 1.0 + float(torch.cumprod(acc, 0).sum())
    weight = float(counts["weight"])
    return {
        "eval_loss": float(counts["loss"]) / weight if weight else float("nan"),
        "eval_acc": [round(a, 4) for a in acc.tolist()],
        "eval_acc_cond": [round(a, 4) for a in acc_cond],
        "eval_tau": round(tau, 4),
        "eval_tau_marginal": round(tau_marginal, 4),
        "eval_blocks": int(blocks),
    }


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    head: FrozenHead,
    batches: Iterable[Batch],
    *,
    block_size: int,
    mask_token_id: int,
    backend: str,
    slot_weights_B: torch.Tensor,
    chunk_tokens: int,
    device: torch.device,
) -> dict[str, Any]:
    """Run the held-out batches (labels = stored target argmax) and return `summarize`d metrics."""
    B = block_size
    counts = {
        "correct": torch.zeros(B, dtype=torch.float64, device=device),
        "valid": torch.zeros(B, dtype=torch.float64, device=device),
        "accepted_hist": torch.zeros(B, dtype=torch.float64, device=device),
        "blocks": torch.zeros((), dtype=torch.float64, device=device),
        "loss": torch.zeros((), dtype=torch.float64, device=device),
        "weight": torch.zeros((), dtype=torch.float64, device=device),
    }
    was_training = model.training
    model.eval()
    for batch in batches:
        batch = batch.to(device)
        hidden_QD = forward_batch(
            model, head, batch, block_size=B, mask_token_id=mask_token_id, backend=backend
        )
        valid_AB = batch.weights_AB > 0
        labels_AB = batch.labels_AB
        pred_AB = greedy_predictions(hidden_QD, head.lm_head_VD, chunk_tokens).view_as(labels_AB)
        correct_AB = (pred_AB == labels_AB) & valid_AB
        block_A = valid_AB.any(dim=1)
        accepted_A = block_acceptance(correct_AB, valid_AB)[block_A]
        counts["correct"] += correct_AB.sum(0)
        counts["valid"] += valid_AB.sum(0)
        counts["accepted_hist"] += torch.bincount(accepted_A, minlength=B).double()
        counts["blocks"] += block_A.sum()
        # Held-out CE with the training slot weights, chunked like the predictions.
        w_Q = (valid_AB * slot_weights_B.to(device)[None]).flatten().double()
        labels_Q = labels_AB.flatten().clamp(min=0)
        for i in range(0, hidden_QD.shape[0], chunk_tokens):
            logits = (hidden_QD[i : i + chunk_tokens] @ head.lm_head_VD.T).float()
            ce = torch.nn.functional.cross_entropy(
                logits, labels_Q[i : i + chunk_tokens], reduction="none"
            )
            counts["loss"] += (ce.double() * w_Q[i : i + chunk_tokens]).sum()
        counts["weight"] += w_Q.sum()
    if dist.is_initialized():
        for value in counts.values():
            dist.all_reduce(value)
    model.train(was_training)
    return summarize({k: v.cpu() for k, v in counts.items()})
