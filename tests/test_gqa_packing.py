"""`run.pack_heads`: the query heads of a key/value group folded into the flex kernel's rows
(stage2_train.attention.pack_heads, BlockAttention(heads_per_group=R), the masks'
rows_per_block). Checked against attention on the unpacked heads built independently (SDPA
with enable_gqa on the dense anchor-block mask): the packing's layout, forward and gradients
through the packed dense mask, and the compiled flex forward on the CPU through BlockAttention,
its mask built here or from the loader's tables (collate with rows_per_block)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_masks import _items
from torch.nn.attention.flex_attention import create_mask

from stage2_train.attention import BlockAttention, pack_heads, tokens_major, unpack_heads
from stage2_train.batch import collate
from stage2_train.masks import TILE, anchor_block_mask_mod, context_intervals

BLOCK, CONTEXT, ANCHORS, DIM = 16, 160, 6, 8


def problem(heads: int, groups: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    docs_S = torch.zeros(CONTEXT, dtype=torch.long)
    docs_S[70:] = 1
    docs_S[121:] = 2
    anchors_A = torch.sort(torch.randperm(CONTEXT - BLOCK, generator=gen)[:ANCHORS] + 1).values
    queries, keys = ANCHORS * BLOCK, CONTEXT + ANCHORS * BLOCK
    q = torch.randn(1, heads, queries, DIM, generator=gen)
    k = torch.randn(1, groups, keys, DIM, generator=gen)
    v = torch.randn(1, groups, keys, DIM, generator=gen)
    return anchors_A, docs_S, q, k, v


def grouped_reference(anchors_A, docs_S, q, k, v) -> torch.Tensor:
    lo_A, hi_A = context_intervals(anchors_A, docs_S)
    mask_mod = anchor_block_mask_mod(lo_A, hi_A, docs_S.numel(), BLOCK)
    dense = create_mask(mask_mod, 1, 1, q.size(2), k.size(2), device="cpu")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)


def test_pack_heads_layout() -> None:
    """Row q*R + r of group g is query q of head g*R + r; unpack_heads inverts it."""
    x = torch.arange(6 * 5).float().reshape(1, 6, 5, 1)  # 6 heads, 5 queries
    packed = pack_heads(x, groups=2)
    assert packed.shape == (1, 2, 15, 1)
    for g in range(2):
        for q in range(5):
            for r in range(3):
                assert packed[0, g, q * 3 + r, 0] == x[0, g * 3 + r, q, 0]
    assert torch.equal(unpack_heads(packed, heads=6), x)
    # both written tokens-major, so block_attention under DFLASH_FLEX_LAYOUT=tokens and
    # o_proj's reshape copy neither again
    for tokens_major_x in (x, x.transpose(1, 2).contiguous().transpose(1, 2)):
        packed = pack_heads(tokens_major_x, groups=2)
        assert tokens_major(packed).data_ptr() == packed.data_ptr()
        unpacked = unpack_heads(packed, heads=6)
        assert tokens_major(unpacked).data_ptr() == unpacked.data_ptr()
        assert torch.equal(unpacked, x)


@pytest.mark.parametrize(("heads", "groups"), [(4, 2), (6, 2), (8, 2)])
def test_packed_attention_equals_grouped_attention(heads: int, groups: int) -> None:
    """Packed rows under the packed mask (rows_per_block = B * R) give the unpacked GQA
    attention's output and gradients (dense SDPA both ways; the reference never packs)."""
    anchors_A, docs_S, q, k, v = problem(heads, groups)
    per_group = heads // groups
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = grouped_reference(anchors_A, docs_S, *leaves)
    want.backward(grad)

    packed_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    lo_A, hi_A = context_intervals(anchors_A, docs_S)
    packed_mod = anchor_block_mask_mod(lo_A, hi_A, CONTEXT, BLOCK, rows_per_block=BLOCK * per_group)
    rows, keys = q.size(2) * per_group, k.size(2)
    packed_dense = create_mask(packed_mod, 1, 1, rows, keys, device="cpu")
    qp = pack_heads(packed_leaves[0], groups)
    out = F.scaled_dot_product_attention(qp, *packed_leaves[1:], attn_mask=packed_dense)
    got = unpack_heads(out, heads)
    got.backward(grad)

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(packed_leaves, leaves, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "groups"), [(8, 2), (6, 2)])
def test_block_attention_packed_flex_forward(heads: int, groups: int) -> None:
    """BlockAttention(heads_per_group=R) on the compiled flex path equals the grouped
    attention on the dense mask (CPU: forward only, flex has no CPU backward); the SDPA path
    ignores the setting."""
    anchors_A, docs_S, q, k, v = problem(heads, groups, seed=3)
    want = grouped_reference(anchors_A, docs_S, q, k, v)
    per_group = heads // groups
    packed = BlockAttention(anchors_A, docs_S, BLOCK, "flex", heads_per_group=per_group)
    assert packed.block_mask is not None and packed.block_mask.shape[-2] == q.size(2) * per_group
    torch.testing.assert_close(packed(q, k, v), want, rtol=1e-4, atol=1e-4)
    dense = BlockAttention(anchors_A, docs_S, BLOCK, "sdpa", heads_per_group=per_group)
    assert dense.heads_per_group == 1
    torch.testing.assert_close(dense(q, k, v), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("narrow", [True, False])
def test_loader_tables_for_packed_rows(narrow: bool) -> None:
    """collate(rows_per_block=B * R) builds the tables BlockAttention(heads_per_group=R) reads:
    the flex forward over a two-sequence batch (test_masks' items) equals the grouped dense reference; tables
    built for unpacked rows are refused (their tile grid does not fit)."""
    heads, groups = 8, 2
    per_group = heads // groups
    items = _items(0, BLOCK, num_anchors=6, num_seqs=2)  # padding tokens and anchors included
    batch = collate(items, rows_per_block=BLOCK * per_group, narrow=narrow)
    anchors_A, docs_T = batch.anchors_A, batch.document_ids_T
    gen = torch.Generator().manual_seed(5)
    queries, keys = anchors_A.numel() * BLOCK, docs_T.numel() + anchors_A.numel() * BLOCK
    q = torch.randn(1, heads, queries, DIM, generator=gen)
    k, v = (torch.randn(1, groups, keys, DIM, generator=gen) for _ in range(2))
    attention = BlockAttention(
        anchors_A, docs_T, BLOCK, "flex", tables=batch.mask_tables, heads_per_group=per_group
    )
    torch.testing.assert_close(
        attention(q, k, v), grouped_reference(anchors_A, docs_T, q, k, v), rtol=1e-4, atol=1e-4
    )
    unpacked = collate(items, narrow=narrow).mask_tables
    if -(-queries // TILE) != -(-queries * per_group // TILE):
        with pytest.raises(AssertionError):
            BlockAttention(
                anchors_A, docs_T, BLOCK, "flex", tables=unpacked, heads_per_group=per_group
            )


def test_drafter_forward_packed_equals_unpacked(tmp_path) -> None:
    """The whole drafter's forward on a store's batch: run.pack_heads (flex, tables from
    collate for B * R rows) gives the hidden states of the unpacked dense path; the setting
    resolves to R only on the flex backend."""
    from pathlib import Path

    from store_factory import FactorySpec, build_store

    from common.config import build_config
    from stage2_train.config import TrainConfig
    from stage2_train.data import StoreSequences
    from stage2_train.inputs import check_inputs
    from stage2_train.model import DFlashDrafter
    from stage2_train.step import forward_batch, load_frozen_head
    from stage2_train.trainstep import packed_heads_per_group

    store = build_store(tmp_path / "store", FactorySpec(num_attention_heads=8))
    debug = Path(__file__).parents[1] / "configs" / "debug.yaml"
    sets = [f"data.store={store}", "run.out=unused", "drafter.num_layers=2", "run.pack_heads=true"]
    cfg = build_config(TrainConfig, debug, "train", sets)
    info, shape = check_inputs(cfg)
    per_group = shape.num_attention_heads // shape.num_key_value_heads
    assert per_group == 4 and packed_heads_per_group(cfg, shape, "flex") == per_group
    assert packed_heads_per_group(cfg, shape, "sdpa") == 1
    torch.manual_seed(0)
    model = DFlashDrafter(shape).eval()
    head = load_frozen_head(store, torch.device("cpu"), torch.float32)
    B = shape.block_size
    sequences = StoreSequences(
        info,
        num_anchors=cfg.anchors.num_anchors,
        per_document=False,
        block_size=B,
        label_target="argmax",
        distill=False,
        seed=0,
    )
    items = [sequences[(0, 0, False)], sequences[(1, 0, False)]]
    packed_batch = collate(items, rows_per_block=B * per_group)
    plain_batch = collate(items, mask_tables=False)
    args = {"block_size": B, "mask_token_id": shape.mask_token_id}
    with torch.no_grad():
        packed = forward_batch(
            model, head, packed_batch, backend="flex", heads_per_group=per_group, **args
        )
        plain = forward_batch(model, head, plain_batch, backend="sdpa", **args)
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
