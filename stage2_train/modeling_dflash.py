"""The DFlash drafter for transformers' AutoModel: `dflash export` copies this file into every
export folder, and config.json's `auto_map` points AutoModel at `DFlashDraftModel`.

    from transformers import AutoModel, AutoModelForCausalLM
    draft = AutoModel.from_pretrained(export, trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype="auto").eval()
    ids = draft.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[eos])

Self-contained on purpose (torch and transformers only): it runs wherever the folder is copied.
It is written from the format of notes/dflash.md, not from any reference implementation:

- context: the target's hidden states after layers `dflash_config.target_layer_ids`,
  concatenated (K*D), fused by `fc` and `hidden_norm`;
- a block: slot 0 holds the last accepted token, slots 1..B-1 `dflash_config.mask_token_id`,
  embedded by the target's own (frozen) embedding; one non-causal pass drafts them all;
- every layer: Q from the block only; K and V from [context; block] through the same
  k_proj/v_proj (and k_norm); RoPE at the real positions; no mask (the context holds exactly
  the tokens before the block);
- the target's own LM head turns the final-normed block states into tokens.

`forward` keeps the keyword interface of the DFlash reference code (`target_hidden`,
`noise_embedding`, `position_ids`, `past_key_values`, `use_cache`): with a DynamicCache the
context K/V stays cached, and the caller crops the cache back to the context after a draft.

Legend: b batch, C new context tokens, Q block tokens (B), N = C + Q, D hidden, H query heads,
G key/value heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight.to(x.dtype), self.eps)


def rope_theta(config: Qwen3Config) -> float:
    """transformers >= 5 keeps rope_theta in rope_parameters; older versions on the config."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def rope_cos_sin(
    positions_bN: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin [b, N, E] of the rotate-half RoPE (no scaling), computed in fp32."""
    exponents = torch.arange(0, head_dim, 2, device=positions_bN.device, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (exponents / head_dim)
    angles = positions_bN.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_bhNE: Tensor, cos_bNE: Tensor, sin_bNE: Tensor) -> Tensor:
    half = x_bhNE.size(-1) // 2
    rotated = torch.cat([-x_bhNE[..., half:], x_bhNE[..., :half]], dim=-1)
    return x_bhNE * cos_bNE[:, None] + rotated * sin_bNE[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        D, H, G, E = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(D, H * E, bias=False)
        self.k_proj = nn.Linear(D, G * E, bias=False)
        self.v_proj = nn.Linear(D, G * E, bias=False)
        self.o_proj = nn.Linear(H * E, D, bias=False)
        self.q_norm = DFlashRMSNorm(E, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(E, config.rms_norm_eps)

    def forward(
        self,
        x_bQD: Tensor,
        context_bCD: Tensor,
        rope: tuple[Tensor, Tensor],
        cache: DynamicCache | None,
    ) -> Tensor:
        b, q_len, _ = x_bQD.shape
        cos_bNE, sin_bNE = rope
        q = self.q_norm(self.q_proj(x_bQD).view(b, q_len, self.num_heads, self.head_dim))
        kv_in_bND = torch.cat([context_bCD, x_bQD], dim=1)
        n = kv_in_bND.size(1)
        k = self.k_norm(self.k_proj(kv_in_bND).view(b, n, self.num_kv_heads, self.head_dim))
        v_bGNE = self.v_proj(kv_in_bND).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_bHQE = apply_rope(q.transpose(1, 2), cos_bNE[:, -q_len:], sin_bNE[:, -q_len:])
        k_bGNE = apply_rope(k.transpose(1, 2), cos_bNE, sin_bNE).to(v_bGNE.dtype)
        if cache is not None:  # earlier context first, then this call's context and block
            k_bGNE, v_bGNE = cache.update(k_bGNE, v_bGNE, self.layer_idx)
        o_bHQE = F.scaled_dot_product_attention(
            q_bHQE.to(v_bGNE.dtype), k_bGNE, v_bGNE, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(o_bHQE.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, context: Tensor, rope: tuple[Tensor, Tensor], cache: DynamicCache | None
    ) -> Tensor:
        # the context is injected as is (already fused and normed): no per-layer norm on it
        x = x + self.self_attn(self.input_layernorm(x), context, rope, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def _embed(embed_tokens: nn.Module | Tensor, ids: Tensor) -> Tensor:
    return F.embedding(ids, embed_tokens) if isinstance(embed_tokens, Tensor) else embed_tokens(ids)


def _logits(lm_head: nn.Module | Tensor, hidden: Tensor) -> Tensor:
    if isinstance(lm_head, Tensor):
        return hidden.to(lm_head.dtype) @ lm_head.T
    return lm_head(hidden.to(lm_head.weight.dtype))


def _cache_kwarg(target: nn.Module) -> str:
    """The name `target.forward` takes its KV cache under: transformers 5.2x renamed
    `past_key_values` to `cache` (the old name warns and goes in 5.40); older releases, the
    GPU image's among them, know only the old one."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions; a negative count means "remove that many" in every
    transformers version (a positive one is refused by recent ones)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


def _pick(logits: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.flatten(0, -2), 1).view(probs.shape[:-1])


class DFlashDraftModel(PreTrainedModel):
    """DFlash drafter: the trainable layers, `fc`, `hidden_norm` and `norm`; the embedding and
    LM head are the target's, passed in by the caller."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = dflash["mask_token_id"]
        self.block_size = dflash.get("block_size") or config.block_size
        D = config.hidden_size
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        position_ids: Tensor,
        noise_embedding: Tensor,
        target_hidden: Tensor,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        **kwargs: object,
    ) -> Tensor:
        """Final-normed states [b, Q, D] of the block `noise_embedding` [b, Q, D].

        target_hidden [b, C, K*D]: tapped target states of the context tokens not yet cached;
        position_ids [b, C + Q] (or [C + Q]): their positions, then the block's.
        """
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        positions = position_ids if position_ids.dim() == 2 else position_ids[None]
        head_dim = self.layers[0].self_attn.head_dim
        rope = rope_cos_sin(positions, head_dim, rope_theta(self.config), dtype)
        x = noise_embedding.to(dtype)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            x = layer(x, context, rope, cache)
        return self.norm(x)

    def target_features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        """[b, T, K*D] context features from a target forward's `output_hidden_states` (layer
        id i is hidden_states[i + 1], the output of decoder layer i)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.inference_mode()
    def draft_block(
        self,
        target_hidden: Tensor,
        last_token: Tensor,
        start: int,
        embed_tokens: nn.Module | Tensor,
        lm_head: nn.Module | Tensor,
        past_key_values: DynamicCache | None = None,
        temperature: float = 0.0,
    ) -> Tensor:
        """Draft B-1 tokens [b, B-1] after `last_token` [b], which sits at position `start`.

        target_hidden [b, C, K*D]: features of positions start - C .. start - 1, i.e. of every
        context token the cache does not hold yet (all of 0 .. start - 1 without a cache).
        The cache is cropped back to `start` afterwards: the block is never context.
        """
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        assert cached + target_hidden.size(1) == start, "context must end right before start"
        b, device = last_token.size(0), last_token.device
        block_ids = torch.full((b, self.block_size), self.mask_token_id, device=device)
        block_ids[:, 0] = last_token
        positions = torch.arange(cached, start + self.block_size, device=device)
        hidden = self(
            position_ids=positions.expand(b, -1),
            noise_embedding=_embed(embed_tokens, block_ids),
            target_hidden=target_hidden,
            past_key_values=past_key_values,
            use_cache=past_key_values is not None,
        )
        if past_key_values is not None:
            _crop(past_key_values, start)
        return _pick(_logits(lm_head, hidden[:, 1:]), temperature)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
    ) -> Tensor:
        """Speculative decoding of one sequence [1, n] with `target` verifying each block;
        greedy (temperature 0) output equals the target's own greedy decoding."""
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        n0 = input_ids.size(1)
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        cached = {_cache_kwarg(target): target_cache, "use_cache": True}
        out = target(input_ids, output_hidden_states=True, **cached)
        ids = torch.cat([input_ids, _pick(out.logits[:, -1:], temperature)], dim=1)
        features = self.target_features(out.hidden_states)
        stops = set(stop_token_ids or [])
        while ids.size(1) - n0 < max_new_tokens and not stops & set(ids[0, n0:].tolist()):
            start = ids.size(1) - 1  # the newest token: verified, not yet run by the target
            draft = self.draft_block(
                features, ids[:, -1], start, embed, head, draft_cache, temperature
            )
            block = torch.cat([ids[:, -1:], draft], dim=1)
            out = target(block, output_hidden_states=True, **cached)
            verified = _pick(out.logits, temperature)
            accepted = int((draft == verified[:, :-1]).cumprod(dim=1).sum())
            ids = torch.cat([ids, draft[:, :accepted], verified[:, accepted : accepted + 1]], dim=1)
            _crop(target_cache, start + accepted + 1)
            features = self.target_features(out.hidden_states)[:, : accepted + 1]
        new = ids[0, n0 : n0 + max_new_tokens].tolist()
        cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
        return ids[:, : n0 + cut]
