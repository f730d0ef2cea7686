"""`sdpa_gqa_decode`: transformers' SDPA attention, with the one-token decode steps of
grouped-query attention run on the key/value heads instead of a repeated copy of the cache.

Why: a decode step of `generate` has one query token per row. Older transformers (the device
image's 5.17) expand the cached keys and values to every query head (`repeat_kv`) before SDPA,
and in fp32 with a padding mask SDPA takes its math path: on the pystd recipe that copy and
the GEMV over the copied cache were ~2/3 of the GPU time of a step (BENCHMARKS.md, "Where
generation's time goes"). Here the `groups` query heads that share a key/value head become
`groups` query rows of that head, so SDPA reads each cached key and value once and nothing is
copied. Prefill (more than one query token) and models without GQA run transformers' own SDPA
path unchanged. Newer transformers do the same inside `sdpa` (`pack_gqa`); this backport makes
the speed independent of the installed version.

Use: `--set target.attn_implementation=sdpa_gqa_decode` (`dflash generate`); the name is
registered with transformers' attention and mask interfaces on import.

Legend: B batch rows, H query heads, K key/value heads, G = H / K, L cached length, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_DECODE = "sdpa_gqa_decode"


def sdpa_gqa_decode_forward(
    module: torch.nn.Module,
    query_BHqD: torch.Tensor,
    key_BKLD: torch.Tensor,
    value_BKLD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: returns ([B, q, H, D], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, num_heads, q_len, head_dim = query_BHqD.shape
    packable = (
        q_len == 1
        and groups > 1
        # terms SDPA's call below would drop (logit soft-capping, T5-style biases, attention
        # sinks): such models take transformers' own path
        and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "s_aux", "sinks"))
        # a mask per query head cannot follow the heads into rows
        and (attention_mask is None or attention_mask.shape[1] == 1)
    )
    if not packable:
        return sdpa_attention_forward(
            module, query_BHqD, key_BKLD, value_BKLD, attention_mask, dropout, scaling, **kwargs
        )
    # query head h uses key/value head h // G (repeat_kv's order), so a plain reshape groups
    # them: [B, H, 1, D] -> [B, K, G, D], the G heads of key/value head k as G query rows
    query_BKGD = query_BHqD.reshape(batch, num_heads // groups, groups, head_dim)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query_BKGD.dtype)
    out_BKGD = F.scaled_dot_product_attention(
        query_BKGD,
        key_BKLD,
        value_BKLD,
        attn_mask=attention_mask,  # [B, 1, 1, L]: the same cached positions for every row
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        is_causal=False,  # one new token sees the whole cache
    )
    return out_BKGD.reshape(batch, 1, num_heads, head_dim), None


AttentionInterface.register(GQA_DECODE, sdpa_gqa_decode_forward)
# the same masks as sdpa: a boolean [B, 1, q, L] mask, or None where SDPA needs none
AttentionMaskInterface.register(GQA_DECODE, sdpa_mask)
