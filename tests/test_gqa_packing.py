"""bench/flex_check.py's GQA packing (the query heads of a key/value group folded into rows,
bench/flex_sweep.py's gqa_packed variants): against attention on the unpacked heads, built
independently (SDPA with enable_gqa on the dense anchor-block mask), forward and gradients,
and the compiled flex forward on the packed rows under create_block_mask's BlockMask."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from stage2_train.attention import block_attention
from stage2_train.masks import anchor_block_mask_mod, context_intervals

_SPEC = importlib.util.spec_from_file_location(
    "flex_check", Path(__file__).resolve().parents[1] / "bench" / "flex_check.py"
)
assert _SPEC is not None and _SPEC.loader is not None
flex_check = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("flex_check", flex_check)  # its dataclass looks its module up
_SPEC.loader.exec_module(flex_check)

BLOCK, CONTEXT, ANCHORS, DIM = 16, 160, 6, 8


def problem(heads: int, groups: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    docs_S = torch.zeros(CONTEXT, dtype=torch.long)
    docs_S[70:] = 1
    docs_S[121:] = 2
    anchors_A = torch.sort(torch.randperm(CONTEXT - BLOCK, generator=gen)[:ANCHORS] + 1).values
    lo_A, hi_A = context_intervals(anchors_A, docs_S)
    mask_mod = anchor_block_mask_mod(lo_A, hi_A, CONTEXT, BLOCK)
    queries, keys = ANCHORS * BLOCK, CONTEXT + ANCHORS * BLOCK
    q = torch.randn(1, heads, queries, DIM, generator=gen)
    k = torch.randn(1, groups, keys, DIM, generator=gen)
    v = torch.randn(1, groups, keys, DIM, generator=gen)
    return mask_mod, q, k, v


def test_pack_heads_layout() -> None:
    """Row q*R + r of group g is query q of head g*R + r; unpack_heads inverts it."""
    x = torch.arange(6 * 5).float().reshape(1, 6, 5, 1)  # 6 heads, 5 queries
    packed = flex_check.pack_heads(x, groups=2)
    assert packed.shape == (1, 2, 15, 1)
    for g in range(2):
        for q in range(5):
            for r in range(3):
                assert packed[0, g, q * 3 + r, 0] == x[0, g * 3 + r, q, 0]
    assert torch.equal(flex_check.unpack_heads(packed, heads=6), x)


@pytest.mark.parametrize(("heads", "groups"), [(4, 2), (6, 2), (8, 2)])
def test_packed_attention_equals_grouped_attention(heads: int, groups: int) -> None:
    """Packed rows under the packed mask give the unpacked GQA attention's output and
    gradients (dense SDPA both ways; the reference never packs)."""
    mask_mod, q, k, v = problem(heads, groups)
    queries, keys = q.size(2), k.size(2)
    per_group = heads // groups
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dense = create_mask(mask_mod, 1, 1, queries, keys, device="cpu")
    want = F.scaled_dot_product_attention(*leaves, attn_mask=dense, enable_gqa=True)
    want.backward(grad)

    packed_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    qp = flex_check.pack_heads(packed_leaves[0], groups)
    packed_mod = flex_check.packed_mask_mod(mask_mod, per_group)
    packed_dense = create_mask(packed_mod, 1, 1, queries * per_group, keys, device="cpu")
    out = F.scaled_dot_product_attention(qp, *packed_leaves[1:], attn_mask=packed_dense)
    got = flex_check.unpack_heads(out, heads)
    got.backward(grad)

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(packed_leaves, leaves, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_packed_flex_forward_matches_the_reference() -> None:
    """The project's compiled flex region on packed rows, BlockMask from create_block_mask at
    64-row tiles (one anchor block of 16 queries x 4 heads a tile), equals the grouped
    attention on the dense mask (CPU: forward only, flex has no CPU backward)."""
    heads, groups = 8, 2
    mask_mod, q, k, v = problem(heads, groups, seed=3)
    queries, keys = q.size(2), k.size(2)
    per_group = heads // groups
    dense = create_mask(mask_mod, 1, 1, queries, keys, device="cpu")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    packed_mod = flex_check.packed_mask_mod(mask_mod, per_group)
    block_mask = create_block_mask(
        packed_mod, 1, None, queries * per_group, keys, device="cpu", BLOCK_SIZE=(64, 64)
    )
    out = block_attention(flex_check.pack_heads(q, groups), k, v, block_mask)
    torch.testing.assert_close(flex_check.unpack_heads(out, heads), want, rtol=1e-4, atol=1e-4)
