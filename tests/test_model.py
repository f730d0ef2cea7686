"""The drafter against an independent per-block reference; compiled flex vs SDPA on CPU.

The reference recomputes every block alone, with only the keys the definition allows (context
[document start, anchor) and its own slots), plain softmax attention and complex-number RoPE:
it shares no code with the model, the masks or the attention module.

Legend: S context tokens, K tapped layers, D hidden, A anchors, B slots, Q = A*B, H/G heads.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from stage2_train.anchors import block_positions, pad_anchors
from stage2_train.attention import (
    BlockAttention,
    block_attention,
    dense_sdpa_attention,
    tokens_major,
)
from stage2_train.config import DrafterConfig
from stage2_train.masks import MaskTables, anchor_mask_tables, context_intervals
from stage2_train.model import (
    DFlashDrafter,
    build_block_inputs,
    drafter_config_json,
    drafter_shape,
)

TARGET = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "num_hidden_layers": 6,
    "max_position_embeddings": 4096,
}
K_TAPPED, VOCAB, MASK_ID, BSZ = 3, 50, 49, 8
DOCS = [70, 50, 30]  # + 10 padding tokens: S = 160 (two KV tiles of context)
ANCHORS = [3, 4, 5, 40, 68, 70, 71, 100, 118, 125, 140]  # close, doc start/end, pad after


def make_model(seed: int = 0, num_layers: int = 2) -> DFlashDrafter:
    torch.manual_seed(seed)
    shape = drafter_shape(
        DrafterConfig(num_layers=num_layers, block_size=BSZ), TARGET, K_TAPPED, VOCAB, MASK_ID
    )
    model = DFlashDrafter(shape)
    with torch.no_grad():  # non-trivial norm weights so that a skipped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs = [d for d, n in enumerate(DOCS) for _ in range(n)] + [-1] * 10
    pos = [i for n in DOCS for i in range(n)] + [0] * 10
    n_ctx = len(docs)
    return {
        "features": torch.randn(n_ctx, K_TAPPED, TARGET["hidden_size"], generator=g),
        "tokens": torch.randint(0, VOCAB - 1, (n_ctx,), generator=g),
        "docs": torch.tensor(docs),
        "pos": torch.tensor(pos),
        "anchors": pad_anchors(torch.tensor(ANCHORS), 12),
        "embed": torch.randn(VOCAB, TARGET["hidden_size"], generator=g),
    }


def run(
    model: DFlashDrafter, b: dict, backend: str, tables: MaskTables | None = None
) -> torch.Tensor:
    ids_AB = build_block_inputs(b["anchors"], b["tokens"], BSZ, MASK_ID)
    attention = BlockAttention(b["anchors"], b["docs"], BSZ, backend=backend, tables=tables)
    return model(
        b["features"],
        b["embed"][ids_AB.flatten()],
        b["pos"],
        block_positions(b["anchors"], b["pos"], BSZ),
        attention,
    )


def _rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x_NHE, pos_N, theta):
    half = x_NHE.size(-1) // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x_NHE.size(-1))
    rot = torch.polar(torch.ones(len(pos_N), half, dtype=torch.float64), pos_N[:, None] * freq)
    z = torch.complex(x_NHE[..., :half], x_NHE[..., half:]) * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def reference_block(model: DFlashDrafter, b: dict, a: int) -> torch.Tensor:
    """Hidden [B, D] of block a, computed alone from its visible keys only (float64)."""
    w = {k: v.double() for k, v in model.state_dict().items()}
    p = int(b["anchors"][a])
    docs, pos = b["docs"].tolist(), b["pos"].double()
    visible = [t for t in range(p) if docs[t] == docs[p]]
    feats = b["features"].double()[visible].flatten(1)
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    ids = [int(b["tokens"][p])] + [MASK_ID] * (BSZ - 1)
    x = b["embed"].double()[ids]
    kv_pos = torch.cat([pos[visible], pos[p] + torch.arange(BSZ)])
    q_pos = pos[p] + torch.arange(BSZ, dtype=torch.float64)
    h_q, h_kv, e = TARGET["num_attention_heads"], TARGET["num_key_value_heads"], TARGET["head_dim"]
    for i in range(model.shape.num_layers):
        L = f"layers.{i}."
        h = _rms(x, w[L + "input_layernorm.weight"])
        q = _rms(
            (h @ w[L + "self_attn.q_proj.weight"].T).view(BSZ, h_q, e),
            w[L + "self_attn.q_norm.weight"],
        )
        src = torch.cat([ctx, h])
        k = _rms(
            (src @ w[L + "self_attn.k_proj.weight"].T).view(-1, h_kv, e),
            w[L + "self_attn.k_norm.weight"],
        )
        v = (src @ w[L + "self_attn.v_proj.weight"].T).view(-1, h_kv, e)
        q, k = _rope(q, q_pos, TARGET["rope_theta"]), _rope(k, kv_pos, TARGET["rope_theta"])
        out = torch.empty(BSZ, h_q, e, dtype=torch.float64)
        for head in range(h_q):
            kv_head = head // (h_q // h_kv)
            scores = q[:, head] @ k[:, kv_head].T / e**0.5
            out[:, head] = torch.softmax(scores, -1) @ v[:, kv_head]
        x = x + out.flatten(1) @ w[L + "self_attn.o_proj.weight"].T
        h = _rms(x, w[L + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ w[L + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ w[L + "mlp.up_proj.weight"].T)) @ w[L + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


def test_state_dict_keys_are_the_export_keys() -> None:
    model = make_model(num_layers=2)
    per_layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    expected = {f"layers.{i}.{k}" for i in range(2) for k in per_layer}
    expected |= {"norm.weight", "fc.weight", "hidden_norm.weight"}
    assert set(model.state_dict()) == expected
    assert model.fc.weight.shape == (32, K_TAPPED * 32)
    assert not any(p.shape[0] == VOCAB for p in model.parameters()), "no embedding/head inside"


def test_drafter_shape_defaults_and_errors() -> None:
    s = drafter_shape(DrafterConfig(), TARGET, 5, VOCAB, MASK_ID)
    assert (s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (
        32,
        4,
        2,
        8,
    )
    assert s.block_size == 16 and s.num_layers == 5 and s.rope_theta == 10000.0
    t5 = {k: v for k, v in TARGET.items() if k not in ("rope_theta", "head_dim")}
    t5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    s = drafter_shape(DrafterConfig(), t5, 5, VOCAB, MASK_ID)
    assert s.rope_theta == 1e6 and s.head_dim == 8
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        drafter_shape(DrafterConfig(num_key_value_heads=3), TARGET, 5, VOCAB, MASK_ID)
    with pytest.raises(ValueError, match="must equal the target's"):
        drafter_shape(DrafterConfig(hidden_size=64), TARGET, 5, VOCAB, MASK_ID)
    with pytest.raises(ValueError, match="mask_token_id"):
        drafter_shape(DrafterConfig(), TARGET, 5, VOCAB, VOCAB)


def test_config_json() -> None:
    s = drafter_shape(DrafterConfig(num_layers=3, block_size=10), TARGET, 3, VOCAB, MASK_ID)
    cfg = drafter_config_json(s, [1, 2, 3], TARGET)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_hidden_layers"] == 3
    assert cfg["block_size"] == 10 and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"] == {
        "target_layer_ids": [1, 2, 3],
        "mask_token_id": MASK_ID,
        "block_size": 10,
    }


def test_build_block_inputs() -> None:
    ids = build_block_inputs(torch.tensor([2, 5, -1]), torch.arange(10) + 100, 4, 7)
    assert ids.tolist() == [[102, 7, 7, 7], [105, 7, 7, 7], [7, 7, 7, 7]]


def test_forward_matches_per_block_reference() -> None:
    model, b = make_model(), make_batch()
    hidden = run(model, b, "sdpa").view(-1, BSZ, TARGET["hidden_size"])
    for a in range(len(ANCHORS)):
        torch.testing.assert_close(
            hidden[a].double(), reference_block(model, b, a), rtol=1e-4, atol=1e-4
        )


def test_no_leak_from_anchor_future_or_other_documents() -> None:
    model, b = make_model(), make_batch()
    base = run(model, b, "sdpa")
    b2 = dict(b)
    b2["features"] = b["features"].clone()
    b2["features"][40:70] += 5.0  # doc 0 at and after anchor 40, incl. the anchor itself
    b2["features"][70:] += 5.0  # the other documents and padding
    out = run(model, b2, "sdpa").view(-1, BSZ, TARGET["hidden_size"])
    torch.testing.assert_close(out[:4], base.view(-1, BSZ, TARGET["hidden_size"])[:4])
    b2["features"][39] += 5.0  # just before anchor 40: must matter
    out = run(model, b2, "sdpa").view(-1, BSZ, TARGET["hidden_size"])
    assert not torch.allclose(out[3], base.view(-1, BSZ, TARGET["hidden_size"])[3])


def test_sdpa_backward() -> None:
    model, b = make_model(), make_batch()
    run(model, b, "sdpa").square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.fixture(scope="module")
def compiled_once():
    """Compile the flex region once (CPU forward) at the model's attention shapes."""
    model, b = make_model(), make_batch()
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        out = run(model, b, "flex")
    return model, b, out, counters["stats"]["unique_graphs"] - before


def test_compiled_flex_matches_sdpa(compiled_once) -> None:
    model, b, flex_out, n_graphs = compiled_once
    assert n_graphs == 1, "one compiled graph for every layer"
    with torch.no_grad():
        torch.testing.assert_close(flex_out, run(model, b, "sdpa"), rtol=1e-5, atol=1e-5)
    # Attention level, a different mask of the same shapes: no recompile.
    g = torch.Generator().manual_seed(3)
    anchors = pad_anchors(torch.tensor([0, 1, 2, 60, 61, 75, 99, 125, 126]), 12)
    flex = BlockAttention(anchors, b["docs"], BSZ, backend="flex")
    dense = BlockAttention(anchors, b["docs"], BSZ, backend="sdpa")
    q = torch.randn(1, 4, 96, 8, generator=g)
    k, v = torch.randn(2, 1, 2, 256, 8, generator=g)
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        torch.testing.assert_close(flex(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-5)
        assert flex.block_mask is not None and dense.mask_1QK is not None
        torch.testing.assert_close(
            block_attention(q, k, v, flex.block_mask), dense_sdpa_attention(q, k, v, dense.mask_1QK)
        )
    assert counters["stats"]["unique_graphs"] == before, "a new mask recompiled the region"


def test_tables_from_the_loader_give_the_same_outputs(compiled_once) -> None:
    """The mask tables the loader builds on CPU, passed in (as forward_batch does), give the
    outputs of the tables built by BlockAttention itself, with no new graph."""
    model, b, flex_out, _ = compiled_once
    lo_A, hi_A = context_intervals(b["anchors"], b["docs"])
    tables = anchor_mask_tables(lo_A, hi_A, b["docs"].numel(), BSZ)
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        torch.testing.assert_close(run(model, b, "flex", tables), flex_out, rtol=0, atol=0)
        torch.testing.assert_close(
            run(model, b, "sdpa", tables), run(model, b, "sdpa"), rtol=0, atol=0
        )
    assert counters["stats"]["unique_graphs"] == before, "the loader's tables recompiled"


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_layers_hand_attention_tokens_major_views(dtype: str) -> None:
    """The q, k and v a layer passes to the attention are views of its projections' rows
    (`tokens_major`: [N, heads, E] rows, viewed [1, H, N, E]), under autocast too, so
    DFLASH_FLEX_LAYOUT=tokens copies none of them; a [1, H, N, E]-contiguous tensor is copied
    once into that layout, same values."""
    model, b = make_model(), make_batch()
    seen = []

    def recording(q, k, v):
        seen.extend((q, k, v))
        return dense_sdpa_attention(q, k, v, dense.mask_1QK)

    dense = BlockAttention(b["anchors"], b["docs"], BSZ, backend="sdpa")
    ids_AB = build_block_inputs(b["anchors"], b["tokens"], BSZ, MASK_ID)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "mixed")
    with torch.no_grad(), autocast:
        model(
            b["features"],
            b["embed"][ids_AB.flatten()],
            b["pos"],
            block_positions(b["anchors"], b["pos"], BSZ),
            recording,
        )
    assert len(seen) == 3 * len(model.layers)
    for x in seen:
        fed = tokens_major(x)
        assert fed.data_ptr() == x.data_ptr() and fed.stride()[1:] == x.stride()[1:], x.stride()
    plain = torch.randn(1, 4, 96, 8)
    fed = tokens_major(plain)
    assert fed.transpose(1, 2).is_contiguous() and torch.equal(fed, plain)
    assert fed.stride() == tokens_major(seen[0][:, :4, :96, :8].clone()).stride()


def _record_flex_inputs(monkeypatch: pytest.MonkeyPatch) -> tuple[BlockAttention, list]:
    """A flex BlockAttention of a small batch, and the list that the compiled flex region,
    replaced by a recorder, fills with each call's q, k and v (it returns q)."""
    import stage2_train.attention as attention_module

    b = make_batch()
    flex = BlockAttention(b["anchors"], b["docs"], BSZ, backend="flex")
    assert flex.block_mask is not None
    fed: list = []
    monkeypatch.setattr(
        attention_module, "_compiled_flex_region", lambda q, k, v, mask: fed.extend((q, k, v)) or q
    )
    return flex, fed


def test_block_attention_feeds_flex_uncopied(monkeypatch: pytest.MonkeyPatch) -> None:
    """DFLASH_FLEX_LAYOUT=tokens: block_attention hands tokens-major q/k/v (the layers'
    layout) to the compiled flex region as they are (no copy forward, views only backward: no
    zero-filled gradient), and anything else converted once, with the same values."""
    import stage2_train.attention as attention_module

    flex, fed = _record_flex_inputs(monkeypatch)
    monkeypatch.setattr(attention_module, "FLEX_LAYOUT", "tokens")
    n_q, n_kv = flex.num_queries, flex.context_len + flex.num_queries
    leaves = [
        torch.randn(n, heads, 8).requires_grad_() for n, heads in ((n_q, 4), (n_kv, 2), (n_kv, 2))
    ]
    views = [x.transpose(0, 1)[None] for x in leaves]
    block_attention(*views, flex.block_mask).sum().backward()
    for view, x in zip(views, fed, strict=True):
        assert x.data_ptr() == view.data_ptr() and torch.equal(x, view)
        chain, stack = [], [x.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None:
                chain.append(type(node).__name__)
                stack.extend(n for n, _ in node.next_functions)
        assert not any(n.startswith(("Select", "Clone", "Copy")) for n in chain), chain
    assert leaves[0].grad is not None and torch.equal(leaves[0].grad, torch.ones_like(leaves[0]))
    fed.clear()
    contiguous = [v.detach().contiguous() for v in views]
    block_attention(*contiguous, flex.block_mask)
    for x, original in zip(fed, contiguous, strict=True):
        assert x.data_ptr() != original.data_ptr() and torch.equal(x, original)
        assert x.transpose(1, 2).is_contiguous()


def test_flex_layout_heads_feeds_flex_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default layout (faster on an H200): block_attention hands flex q/k/v contiguous
    heads-major, the same values; an unknown layout is refused with the choices."""
    import stage2_train.attention as attention_module

    monkeypatch.delenv("DFLASH_FLEX_LAYOUT", raising=False)
    monkeypatch.setattr(attention_module, "FLEX_LAYOUT", attention_module._layout_from_env())
    assert attention_module.FLEX_LAYOUT == "heads"
    flex, fed = _record_flex_inputs(monkeypatch)
    n_q, n_kv = flex.num_queries, flex.context_len + flex.num_queries
    views = [
        torch.randn(n, h, 8).transpose(0, 1)[None] for n, h in ((n_q, 4), (n_kv, 2), (n_kv, 2))
    ]
    block_attention(*views, flex.block_mask)
    for x, view in zip(fed, views, strict=True):
        assert x.is_contiguous() and not view.is_contiguous() and torch.equal(x, view)
    monkeypatch.setenv("DFLASH_FLEX_LAYOUT", "rows")
    with pytest.raises(ValueError, match="tokens or heads"):
        attention_module._layout_from_env()


def test_flex_refuses_to_run_unfused(compiled_once) -> None:
    _, b, _, _ = compiled_once
    attention = BlockAttention(b["anchors"], b["docs"], BSZ, backend="flex")
    q, k, v = torch.randn(1, 4, 96, 8), torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="unfused"):
        attention(q, k, v)


def test_auto_backend_on_cpu_is_sdpa() -> None:
    b = make_batch()
    assert BlockAttention(b["anchors"], b["docs"], BSZ).backend == "sdpa"
    with pytest.raises(ValueError):
        BlockAttention(b["anchors"], b["docs"], BSZ, backend="eager")  # type: ignore[arg-type]


def test_the_exported_drafter_takes_the_target_positions() -> None:
    """max_position_embeddings of the drafter's config.json: the target's limit as
    max_positions reads it (an alias, rope scaling), 40960 only when none is named."""
    base = {k: v for k, v in TARGET.items() if k != "max_position_embeddings"}
    shape = drafter_shape(DrafterConfig(num_layers=1, block_size=4), base, 3, 50, 49)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    for extra, expected in [
        ({"max_position_embeddings": 4096}, 4096),
        ({"n_positions": 2048}, 2048),
        ({"max_position_embeddings": 40960, "rope_scaling": yarn}, 131072),
        ({"max_position_embeddings": 40960, "rope_parameters": yarn}, 131072),
        ({}, 40960),
    ]:
        config = drafter_config_json(shape, [1, 2, 3], {**base, **extra})
        assert config["max_position_embeddings"] == expected, extra
        assert config["rope_scaling"] is None


def test_the_exported_drafter_reads_a_nested_text_config() -> None:
    """A multimodal target nests its decoder's config in text_config: a dict in the config the
    store keeps (config_dict's JSON), an object or a dict in a config in memory. The drafter's
    max_position_embeddings (rope scaling included) and num_target_layers come from it, not
    40960 and None; max_positions reads it the same way, dict or object."""
    from types import SimpleNamespace

    from transformers import (
        Gemma3Config,
        Gemma3TextConfig,
        LlamaConfig,
        PretrainedConfig,
        Qwen3Config,
    )

    from stage1_extract.target import config_dict, max_positions

    shape = drafter_shape(DrafterConfig(num_layers=1, block_size=4), TARGET, 3, 50, 49)
    qwen3 = Qwen3Config(**TARGET)  # 4096 positions, 6 layers
    linear = {"rope_type": "linear", "factor": 2.0}
    llama = LlamaConfig(**{**TARGET, "max_position_embeddings": 2048}, rope_scaling=linear)
    sizes = {k: v for k, v in TARGET.items() if k not in ("rope_theta", "max_position_embeddings")}
    gemma3 = Gemma3Config(text_config=Gemma3TextConfig(**sizes, max_position_embeddings=8192))
    for target_config, expected in [
        (config_dict(gemma3), 8192),  # as extract stores a multimodal target's config
        ({"model_type": "qwen2_5_vl", "text_config": qwen3.to_dict()}, 4096),
        ({"model_type": "qwen2_5_vl", "text_config": qwen3}, 4096),
        ({"model_type": "llava", "text_config": config_dict(llama)}, 4096),  # 2048 x 2
    ]:
        config = drafter_config_json(shape, [1, 2, 3], target_config)
        assert config["max_position_embeddings"] == expected, target_config["model_type"]
        assert config["num_target_layers"] == 6, target_config["model_type"]
    for parent in (
        PretrainedConfig(text_config=llama.to_dict()),  # get_text_config gives the dict back
        SimpleNamespace(text_config=llama.to_dict()),
        SimpleNamespace(text_config=llama),
    ):
        found = max_positions(parent)  # type: ignore[arg-type]
        assert found is not None and found.limit == 4096, parent


def test_drafter_shape_takes_the_full_attention_theta() -> None:
    """transformers 5 keeps Gemma 3's rope settings by layer type (sliding layers theta 1e4,
    full-attention ones 1e6 with the 4B+ models' linear scaling): the drafter attends over the
    whole context, so it takes the full-attention theta, as from a transformers 4 config
    (rope_theta, rope_local_base_freq), and the export keeps plain RoPE at that theta. Keyed
    by layer types none of which is full attention, the theta is set by hand."""
    from transformers import Gemma3Config, Gemma3TextConfig

    from stage1_extract.target import config_dict

    sizes = {k: v for k, v in TARGET.items() if k not in ("rope_theta", "max_position_embeddings")}
    linear = {"rope_type": "linear", "factor": 8.0}
    text = Gemma3TextConfig(**sizes, rope_scaling=linear)
    assert set(text.rope_parameters) == {"full_attention", "sliding_attention"}
    t4 = {**sizes, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": linear}
    for target_config in (config_dict(text), config_dict(Gemma3Config(text_config=text)), t4):
        s = drafter_shape(DrafterConfig(num_layers=1, block_size=4), target_config, 3, 50, 49)
        assert s.rope_theta == 1e6
        config = drafter_config_json(s, [1, 2, 3], target_config)
        assert (config["rope_theta"], config["rope_scaling"]) == (1e6, None)
    by_type = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
        "indexed_attention": {"rope_type": "default", "rope_theta": 8e7},
    }
    with pytest.raises(ValueError, match="rope_theta is unknown: set drafter.rope_theta"):
        drafter_shape(DrafterConfig(), {**sizes, "rope_parameters": by_type}, 5, VOCAB, MASK_ID)


def test_drafter_shape_reads_a_nested_text_config() -> None:
    """A multimodal target's stored config nests the decoder's sizes under text_config (a
    dict): the drafter takes its sizes from there, and a width other than the decoder's is
    refused also when every size is set by hand."""
    from transformers import Gemma3Config, Gemma3TextConfig, Qwen3Config

    from stage1_extract.target import config_dict

    qwen3_vl = {"model_type": "qwen2_5_vl", "text_config": Qwen3Config(**TARGET).to_dict()}
    s = drafter_shape(DrafterConfig(), qwen3_vl, 5, VOCAB, MASK_ID)
    assert (s.hidden_size, s.intermediate_size, s.num_attention_heads) == (32, 48, 4)
    assert (s.num_key_value_heads, s.head_dim, s.rope_theta, s.rms_norm_eps) == (2, 8, 1e4, 1e-6)
    sizes = {k: v for k, v in TARGET.items() if k not in ("rope_theta", "max_position_embeddings")}
    # Gemma 3 nests its rope parameters by layer type: the full-attention layers' theta
    gemma3 = config_dict(Gemma3Config(text_config=Gemma3TextConfig(**sizes)))
    s = drafter_shape(DrafterConfig(), gemma3, 5, VOCAB, MASK_ID)
    assert (s.hidden_size, s.intermediate_size, s.num_key_value_heads, s.head_dim) == (32, 48, 2, 8)
    assert s.rope_theta == 1e6
    by_hand = {k: v for k, v in TARGET.items() if hasattr(DrafterConfig, k)}
    for target_config in (qwen3_vl, gemma3):
        with pytest.raises(ValueError, match=r"hidden_size \(64\) must equal the target's \(32\)"):
            cfg = DrafterConfig(hidden_size=64)
            drafter_shape(cfg, target_config, 5, VOCAB, MASK_ID)
        with pytest.raises(ValueError, match=r"hidden_size \(64\) must equal the target's \(32\)"):
            cfg = DrafterConfig(**{**by_hand, "hidden_size": 64})
            drafter_shape(cfg, target_config, 5, VOCAB, MASK_ID)
