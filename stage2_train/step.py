"""One drafter forward on a loader batch, shared by training and evaluation.

The frozen parts of the target (token embedding and LM head) come from the store's
`target_head.safetensors` and stay plain tensors outside the module: they are never trained,
never in the optimizer, never all-reduced, and the target checkpoint is never opened.

Legend: T context tokens, K tapped layers, D hidden size, V vocabulary, A anchors,
B block size, Q = A*B query tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from common.store import HEAD_FILE, StoreError, decode_scaled_hidden
from stage2_train.anchors import block_positions
from stage2_train.attention import BlockAttention
from stage2_train.data import Batch
from stage2_train.model import build_block_inputs


@dataclass
class FrozenHead:
    """The target's token embedding and LM head, frozen, and its final-norm weight (only an
    initial value for the drafter's own norm)."""

    embed_VD: torch.Tensor
    lm_head_VD: torch.Tensor
    final_norm_D: torch.Tensor


def load_frozen_head(store: str | Path, device: torch.device, dtype: torch.dtype) -> FrozenHead:
    """Read the embedding, LM head and final-norm weight from the store (the drafter applies
    its own `norm` before the target's head; the target's only seeds it)."""
    path = Path(store) / HEAD_FILE
    if not path.is_file():
        raise StoreError(f"{store}: {HEAD_FILE} is missing; re-run `dflash extract`")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        embed_VD = f.get_tensor("embed_tokens.weight")
        head_VD = f.get_tensor("lm_head.weight")
        norm_D = f.get_tensor("norm.weight")
    return FrozenHead(embed_VD.to(device, dtype), head_VD.to(device, dtype), norm_D.to(device))


def forward_batch(
    model: torch.nn.Module,
    head: FrozenHead,
    batch: Batch,
    *,
    block_size: int,
    mask_token_id: int,
    backend: str,
    heads_per_group: int = 1,
) -> torch.Tensor:
    """The drafter's final hidden states hidden_QD for every block slot of the batch;
    `heads_per_group` > 1 packs the query heads into flex's rows (`run.pack_heads`; the
    batch's tables then built for B * R rows a block)."""
    block_ids_AB = build_block_inputs(batch.anchors_A, batch.tokens_T, block_size, mask_token_id)
    block_inputs_QD = F.embedding(block_ids_AB.flatten(), head.embed_VD)
    attention = BlockAttention(
        batch.anchors_A,
        batch.document_ids_T,
        block_size,
        backend,
        tables=batch.mask_tables,
        heads_per_group=heads_per_group,
    )
    dtype = head.embed_VD.dtype
    if batch.hidden_scale_TK is None:
        features_TKD = batch.hidden_TKD.to(dtype)
    else:  # fp8 or nvfp4 store: decoded here, on the device, from the bytes the loader moved
        hidden_size = head.embed_VD.shape[1]
        features_TKD = decode_scaled_hidden(
            batch.hidden_TKD,
            batch.hidden_scale_TK,
            hidden_size,
            dtype,
            compiled=batch.hidden_TKD.is_cuda,  # one graph, not ~10 eager passes a step
        )
    return model(
        features_TKD,
        block_inputs_QD,
        batch.position_ids_T,
        block_positions(batch.anchors_A, batch.position_ids_T, block_size),
        attention,
    )


def greedy_predictions(
    hidden_QD: torch.Tensor, lm_head_VD: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """argmax over the vocabulary, chunk by chunk (never the whole Q x V logit matrix)."""
    out = [
        (hidden_QD[i : i + chunk_tokens] @ lm_head_VD.T).argmax(-1)
        for i in range(0, hidden_QD.shape[0], chunk_tokens)
    ]
    return torch.cat(out)
