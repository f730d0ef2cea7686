"""DFlash drafting at evaluation time, with the drafter's context K/V cached across steps.

In every drafter layer the context's keys and values are projections of the fused target
features (`hidden_norm(fc(features))`, the same input in every layer: the context is injected,
not transformed by the layers) at the context token's own position. They depend on nothing
the block does, so each context token's K/V is computed once, when its features arrive, and
appended per layer; a draft step then runs only the B block tokens through the layers,
attending to the cached context and to the whole block.

The block forward is the drafter's own `forward` (no copy of the layer code): it gets a
one-row placeholder context (zero features; the forward cannot take an empty one) and an
attention callable that drops the placeholder's K/V and puts the cached context K/V of the
layer it is called for in front of the block's own. What that attention sees equals the training
mask at one anchor p = len(tokens) - 1: every context position < p (the feature buffer holds
exactly those) and every slot of the block.

Legend: N new context tokens, T cached context tokens, B block size (= Q query tokens),
P = 1 + Q (placeholder row + block), S = T + Q keys attended,
K tapped layers, D hidden, H query heads, G key/value heads, E head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from evaluation.acceptance import DECODE_SDPA, DraftFn
from stage2_train.model import DFlashDrafter, apply_rope, rope_cos_sin


class _ContextAttention:
    """(q, k, v) of the block -> attention over [cached context; block] of the next layer.

    DFlashDrafter.forward calls its attention once per layer, in layer order: the counter
    says which layer's cache goes in front.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor]) -> None:
        self.keys, self.values = keys, values
        self.layer = 0

    def __call__(self, q_1HQE: Tensor, k_1GPE: Tensor, v_1GPE: Tensor) -> Tensor:
        # P = 1 + Q: the placeholder context row first, then the block.
        k_1GSE = torch.cat([self.keys[self.layer], k_1GPE[:, :, 1:]], dim=2)
        v_1GSE = torch.cat([self.values[self.layer], v_1GPE[:, :, 1:]], dim=2)
        self.layer += 1
        # No mask: each block query may see all of the cached context and its whole block.
        return F.scaled_dot_product_attention(
            q_1HQE, k_1GSE, v_1GSE, enable_gqa=q_1HQE.size(1) != k_1GSE.size(1)
        )


def dflash_draft_fn(drafter: DFlashDrafter, embed_VD: Tensor, head_VD: Tensor) -> DraftFn:
    """A draft function for ONE sequence (make a new one per prompt): drafts B-1 tokens per
    call from the features of every token but the newest, caching the context K/V."""
    shape = drafter.shape
    device = embed_VD.device
    dtype = drafter.fc.weight.dtype
    num_kv, head_dim = shape.num_key_value_heads, shape.head_dim
    offsets_B = torch.arange(shape.block_size, device=device)
    keys = [torch.empty(1, num_kv, 0, head_dim, device=device, dtype=dtype)] * shape.num_layers
    values = list(keys)
    placeholder_1KD = torch.zeros(1, shape.num_tapped, shape.hidden_size, device=device)
    placeholder_1 = torch.zeros(1, dtype=torch.long, device=device)

    def extend(new_NKD: Tensor, start: int) -> None:
        """Append the K/V of context tokens start..start+N-1 to every layer's cache."""
        n = new_NKD.size(0)
        context_ND = drafter.hidden_norm(drafter.fc(new_NKD.reshape(n, -1).to(dtype)))
        positions_N = torch.arange(start, start + n, device=device)
        cos_NE, sin_NE = rope_cos_sin(positions_N, head_dim, shape.rope_theta, dtype)
        # Exactly DFlashAttention.forward's context half: k_proj, k_norm, RoPE; v_proj.
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            k_NGE = attn.k_norm(attn.k_proj(context_ND).view(n, num_kv, head_dim))
            v_NGE = attn.v_proj(context_ND).view(n, num_kv, head_dim)
            k_1GNE = apply_rope(k_NGE.transpose(0, 1)[None], cos_NE, sin_NE)
            keys[i] = torch.cat([keys[i], k_1GNE.to(dtype)], dim=2)
            values[i] = torch.cat([values[i], v_NGE.transpose(0, 1)[None]], dim=2)

    @torch.inference_mode()
    @sdpa_kernel(DECODE_SDPA)
    def draft(tokens: list[int], feats_TKD: Tensor | None) -> list[int]:
        assert feats_TKD is not None and feats_TKD.size(0) == len(tokens) - 1
        cached = keys[0].size(2)
        assert feats_TKD.size(0) >= cached, "one draft function per sequence"
        if feats_TKD.size(0) > cached:
            extend(feats_TKD[cached:], cached)
        p = len(tokens) - 1
        ids_B = torch.full((shape.block_size,), shape.mask_token_id, device=device)
        ids_B[0] = tokens[p]
        attention = _ContextAttention(keys, values)
        hidden_BD = drafter(
            placeholder_1KD, embed_VD[ids_B], placeholder_1, p + offsets_B, attention
        )
        assert attention.layer == shape.num_layers
        logits_BV = hidden_BD.to(head_VD.dtype) @ head_VD.T
        return logits_BV[1:].argmax(-1).tolist()

    return draft
