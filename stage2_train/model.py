"""The DFlash drafter: Qwen3-style decoder layers with target-feature KV injection.

One forward drafts every anchor block of ONE packed sequence (no batch dim; loop over
sequences for micro-batches). Context: the K tapped target layers of each position,
concatenated (K*D) and fused by ``fc`` + ``hidden_norm``. In every layer K and V are
``[proj(context); proj(block tokens)]`` with the same k_proj/v_proj and k_norm, Q comes from
the block tokens only, and RoPE uses the real document-relative positions (context token t at
position_ids[t], slot j of anchor p at position_ids[p] + j). Which key a query may see is the
attention object's business (stage2_train.attention.BlockAttention). The frozen embedding and
LM head belong to the caller: they are not parameters here and not in the state dict, whose
keys are exactly those of the exported ``model.safetensors``.

Legend: T context tokens (= S), K tapped layers, D hidden, Q = A*B block tokens, H query
heads, G key/value heads, E head dim, F intermediate size, A anchors, B block size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.target_config import text_config
from stage2_train.config import DrafterConfig

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q_1HQE, k_1GKE, v_1GKE) -> o_1HQE


@dataclass
class DrafterShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_tapped: int
    block_size: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    mask_token_id: int


def _rope_theta(text: Any) -> float | None:
    # transformers >= 5 moved rope_theta into rope_parameters, keyed by layer type on models
    # with sliding-window layers (Gemma 3: {"full_attention": {...}, "sliding_attention":
    # {...}}). The drafter attends over the whole context: the full-attention layers' theta.
    theta = getattr(text, "rope_theta", None)
    if theta is None:
        rope = getattr(text, "rope_parameters", None) or {}
        theta = (rope.get("full_attention") or rope).get("rope_theta")
    return theta


def drafter_shape(
    cfg: DrafterConfig, target_config: dict, num_tapped: int, vocab_size: int, mask_token_id: int
) -> DrafterShape:
    """Drafter sizes: the config's values, else the target's decoder's (store attrs
    ``target.config``, or its nested ``text_config`` for a multimodal target)."""
    text = text_config(target_config)

    def target(name: str) -> Any:
        return getattr(text, name, None)

    heads = cfg.num_attention_heads or target("num_attention_heads")
    values = {
        "hidden_size": cfg.hidden_size or target("hidden_size"),
        "intermediate_size": cfg.intermediate_size or target("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_key_value_heads or target("num_key_value_heads") or heads,
        "head_dim": cfg.head_dim or target("head_dim"),
        "rope_theta": cfg.rope_theta or _rope_theta(text),
        "rms_norm_eps": cfg.rms_norm_eps or target("rms_norm_eps"),
    }
    if values["head_dim"] is None and values["hidden_size"] and heads:
        values["head_dim"] = values["hidden_size"] // heads
    problems = [f"{k} is unknown: set drafter.{k}" for k, v in values.items() if v is None]
    if not problems:
        if values["num_attention_heads"] % values["num_key_value_heads"]:
            problems.append(
                f"num_attention_heads ({values['num_attention_heads']}) must be a multiple of "
                f"num_key_value_heads ({values['num_key_value_heads']})"
            )
        # The frozen embedding and LM head are the target's: the width must match.
        width = target("hidden_size")
        if width is not None and values["hidden_size"] != width:
            problems.append(
                f"hidden_size ({values['hidden_size']}) must equal the target's "
                f"({width}): the drafter reuses its embedding and LM head"
            )
    if num_tapped < 1:
        problems.append(f"num_tapped must be >= 1, got {num_tapped}")
    if not 0 <= mask_token_id < vocab_size:
        problems.append(f"mask_token_id {mask_token_id} is not a row of the {vocab_size}-row vocab")
    if problems:
        raise ValueError("invalid drafter shape: " + "; ".join(problems))
    return DrafterShape(
        num_layers=cfg.num_layers,
        num_tapped=num_tapped,
        block_size=cfg.block_size,
        vocab_size=vocab_size,
        mask_token_id=mask_token_id,
        **values,
    )


def drafter_config_json(shape: DrafterShape, tapped_layers: list[int], target_config: dict) -> dict:
    """config.json of the exported drafter (a Qwen3 config of its own sizes + DFlash fields).

    Its max_position_embeddings is the target's limit as extract and evaluate take it
    (`max_positions`: the attribute or an alias, raised by the target's rope scaling): the
    drafter runs at the target's positions with plain RoPE (rope_scaling None), and serving
    code reads this value as the drafter's context length. 40960 (Qwen3's) when the target's
    config names no limit. Both it and num_target_layers are the decoder's: a multimodal
    target's nested text_config (a dict in the stored config, or an object)."""
    # imported here: the module that reads targets (and stores) stays out of the model's imports
    from stage1_extract.target import max_positions

    # the stored dict as it is: PretrainedConfig.from_dict would re-run transformers' rope
    # standardisation on it (and fails on some)
    found = max_positions(target_config)
    num_layers = getattr(text_config(target_config), "num_hidden_layers", None)
    block = {
        "target_layer_ids": list(tapped_layers),
        "mask_token_id": shape.mask_token_id,
        "block_size": shape.block_size,
    }
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": found.limit if found else 40960,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        # Versions of the reference code read block_size from the top level or dflash_config.
        "block_size": shape.block_size,
        "num_target_layers": num_layers,
        "dflash_config": block,
    }


def build_block_inputs(
    anchors_A: Tensor, tokens_S: Tensor, block_size: int, mask_token_id: int
) -> Tensor:
    """Block token ids [A, B]: slot 0 = tokens[p], slots 1.. = mask id (padding rows: all mask)."""
    ids_AB = torch.full(
        (anchors_A.numel(), block_size), mask_token_id, dtype=torch.long, device=tokens_S.device
    )
    valid_A = anchors_A >= 0
    ids_AB[:, 0] = torch.where(valid_A, tokens_S[anchors_A.clamp(min=0)].long(), mask_token_id)
    return ids_AB


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel on CUDA with fp32 statistics (Qwen3 also normalises in fp32; it
        # rounds once more, before the weight). The eager fp32 form cost ~4 extra passes.
        return F.rms_norm(x, (x.size(-1),), self.weight.to(x.dtype), self.eps)


def rope_cos_sin(
    positions_N: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin [N, E] of the rotate-half RoPE (Qwen3 default, no scaling)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions_N.device, dtype=torch.float32) / head_dim
    )
    angles_NE2 = positions_N.float()[:, None] * inv_freq[None, :]
    angles_NE = torch.cat([angles_NE2, angles_NE2], dim=-1)
    return angles_NE.cos().to(dtype), angles_NE.sin().to(dtype)


def apply_rope(x_1HNE: Tensor, cos_NE: Tensor, sin_NE: Tensor) -> Tensor:
    half = x_1HNE.size(-1) // 2
    rotated = torch.cat([-x_1HNE[..., half:], x_1HNE[..., :half]], dim=-1)
    return x_1HNE * cos_NE + rotated * sin_NE


class DFlashAttention(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            s.num_attention_heads,
            s.num_key_value_heads,
            s.head_dim,
        )
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def forward(
        self, x_QD: Tensor, context_TD: Tensor, rope: tuple[Tensor, Tensor], attention: Attention
    ) -> Tensor:
        cos_NE, sin_NE = rope  # N = T + Q: context positions, then block positions
        n_q = x_QD.size(0)
        q_QHE = self.q_norm(self.q_proj(x_QD).view(n_q, self.num_heads, self.head_dim))
        kv_in_ND = torch.cat([context_TD, x_QD], dim=0)
        k_NGE = self.k_norm(self.k_proj(kv_in_ND).view(-1, self.num_kv_heads, self.head_dim))
        v_NGE = self.v_proj(kv_in_ND).view(-1, self.num_kv_heads, self.head_dim)
        q_1HQE = apply_rope(q_QHE.transpose(0, 1)[None], cos_NE[-n_q:], sin_NE[-n_q:])
        k_1GNE = apply_rope(k_NGE.transpose(0, 1)[None], cos_NE, sin_NE)
        v_1GNE = v_NGE.transpose(0, 1)[None]
        # under autocast RoPE's fp32 tables promote q and k: attention takes one dtype
        o_1HQE = attention(q_1HQE.to(v_1GNE.dtype), k_1GNE.to(v_1GNE.dtype), v_1GNE)
        return self.o_proj(o_1HQE[0].transpose(0, 1).reshape(n_q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(s)
        self.mlp = DFlashMLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(
        self, x_QD: Tensor, context_TD: Tensor, rope: tuple[Tensor, Tensor], attention: Attention
    ) -> Tensor:
        # The context is injected as is (already fused + normed): no per-layer norm on it.
        x_QD = x_QD + self.self_attn(self.input_layernorm(x_QD), context_TD, rope, attention)
        return x_QD + self.mlp(self.post_attention_layernorm(x_QD))


class DFlashDrafter(nn.Module):
    """Trainable part of the drafter; embedding and LM head stay outside (frozen, the target's)."""

    def __init__(self, shape: DrafterShape) -> None:
        super().__init__()
        self.shape = shape
        d = shape.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(d, shape.rms_norm_eps)
        self.fc = nn.Linear(shape.num_tapped * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, shape.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3's init: normal(0, 0.02) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        features_TKD: Tensor,
        block_inputs_QD: Tensor,
        context_positions_T: Tensor,
        block_positions_Q: Tensor,
        attention: Attention,
    ) -> Tensor:
        """Final-normed hidden states [Q, D] of the block tokens, ready for the LM head.

        features_TKD: raw tapped hidden states (any float dtype; cast to the weights' dtype).
        block_inputs_QD: embeddings of build_block_inputs(...) flattened to Q = A*B rows.
        attention: BlockAttention of this sequence (or any (q, k, v) -> o with its layout).
        """
        dtype = self.fc.weight.dtype
        n_ctx = features_TKD.size(0)
        context_TD = self.hidden_norm(self.fc(features_TKD.reshape(n_ctx, -1).to(dtype)))
        positions_N = torch.cat([context_positions_T, block_positions_Q]).to(context_TD.device)
        rope = rope_cos_sin(positions_N, self.shape.head_dim, self.shape.rope_theta, dtype)
        x_QD = block_inputs_QD.to(dtype)
        for layer in self.layers:
            x_QD = layer(x_QD, context_TD, rope, attention)
        return self.norm(x_QD)

    def compile_layers(self, cuda_graphs: bool = False) -> None:
        """torch.compile each decoder layer (fixed shapes); attention stays its own region.

        block_attention is behind torch.compiler.disable, so a layer compiles to two graphs
        (before and after attention), shared by all layers, and flex keeps its own graph.
        `cuda_graphs` compiles them in reduce-overhead mode: on a GPU each graph (forward and
        backward) replays as a CUDA graph, recorded for every place it runs in a step (each
        layer and micro-batch, forward and backward; evaluations record their own), the
        parameters being static inputs; the training step marks each step's start
        (`torch.compiler.cudagraph_mark_step_begin` in `StepRunner.queue`).
        """
        mode = "reduce-overhead" if cuda_graphs else None
        for layer in self.layers:
            layer.compile(dynamic=False, mode=mode)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def shape_dict(shape: DrafterShape) -> dict:
    """The shape as a plain dict (for checkpoint metadata)."""
    return asdict(shape)
