"""How `bench/flex_sweep.py` checks a variant (issue 12): one attention call's inputs
(`Problem`), the fp32 SDPA reference on the same dense mask, relative errors and the validity
rule (``valid`` is false when any error exceeds 3x the baseline's, or 1e-2); and the block
permutations of the anchor orderings (rows and the block K/V slots put in another anchor order,
the output and gradients put back in the reference's order before the check).

Imported by bench/flex_sweep.py and bench/bench_attention.py (bench/ is on sys.path); the sweep
runs as `python bench/bench_attention.py --sweep` (see there).

Legend: H query heads, G key/value heads, Q = A*B query tokens, KV = S + Q keys, E head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from stage2_train.attention import flex_layout


@dataclass
class Problem:
    """Inputs of one attention call: q [1,H,Q,E], k/v [1,G,KV,E] (leaves), grad [1,H,Q,E]."""

    q: Tensor
    k: Tensor
    v: Tensor
    grad: Tensor
    ctx_lo_A: Tensor
    ctx_hi_A: Tensor
    context_len: int
    block_size: int
    mask_mod: Callable


def reference(p: Problem, backward: bool) -> dict[str, Tensor]:
    """fp32 SDPA on the dense mask: the output and, with backward, the input gradients."""
    q_len, kv_len = p.q.size(2), p.k.size(2)
    q_idx = torch.arange(q_len, device=p.q.device)[:, None]
    kv_idx = torch.arange(kv_len, device=p.q.device)[None, :]
    dense = p.mask_mod(0, 0, q_idx, kv_idx)
    q, k, v = (t.detach().float().requires_grad_(backward) for t in (p.q, p.k, p.v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    ref = {"out": out.detach()}
    if backward:
        out.backward(p.grad.float())
        ref.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return ref


def rel_err(x: Tensor, ref: Tensor) -> float:
    return float(f"{((x.float() - ref).norm() / ref.norm()).item():.3g}")


def judge(record: dict, baseline: dict | None, backward: bool) -> None:
    """valid: every error within 3x the baseline's (or 1e-2); speedup vs the baseline."""
    keys = [k for k in record if k.startswith("rel_err_")]
    if baseline is None:
        record["valid"] = all(record[k] < 1e-2 for k in keys)
        return
    record["valid"] = all(record[k] <= max(3 * baseline.get(k, 0.0), 1e-2) for k in keys)
    key = "fwd_bwd_ms" if backward else "fwd_ms"
    if key in record and key in baseline:
        record["speedup_vs_project"] = round(baseline[key] / record[key], 3)


def permute_rows(x_1HQE: Tensor, perm_A: Tensor, block_size: int) -> Tensor:
    """Rows grouped in blocks of `block_size`, blocks taken in the order perm_A."""
    _, heads, q_len, dim = x_1HQE.shape
    blocks = x_1HQE.reshape(1, heads, q_len // block_size, block_size, dim)
    return blocks[:, :, perm_A].reshape(x_1HQE.shape)


def permute_blocks(p: Problem, perm_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q rows and the block part of k/v in block order perm_A, as new leaves."""
    S, B, grads = p.context_len, p.block_size, p.q.requires_grad
    # new leaves in the layout block_attention hands flex, as the unpermuted inputs are
    # (bench_attention's --layout), so no conversion inside the timed region
    q = flex_layout(permute_rows(p.q.detach(), perm_A, B)).requires_grad_(grads)
    kv = []
    for t in (p.k, p.v):
        t = t.detach()
        block_part = permute_rows(t[:, :, S:], perm_A, B)
        kv.append(flex_layout(torch.cat([t[:, :, :S], block_part], dim=2)).requires_grad_(grads))
    return q, kv[0], kv[1]


def unpermute(p: Problem, name: str, value: Tensor, perm_A: Tensor) -> Tensor:
    """An output ("out") or gradient ("dq", "dk", "dv") from block order perm_A back to the
    reference's order (k/v: only the block part after the S context keys moves)."""
    S, B, inverse_A = p.context_len, p.block_size, torch.argsort(perm_A)
    if name in ("out", "dq"):
        return permute_rows(value, inverse_A, B)
    return torch.cat([value[:, :, :S], permute_rows(value[:, :, S:], inverse_A, B)], dim=2)
