"""What the public DFlash serving code reads from a `dflash export` folder, pinned on a real
export of a tiny target: the config.json keys and their meaning, and the tensor names, shapes
and dtypes, so that a change to the export cannot silently stop a server from loading it, or
make one load it with another meaning (a misnamed tensor that SGLang skips stays random; a
layer that vLLM or SGLang run causal drafts differently from training).

The lists below were written from the servers' loaders as read (never copied), each comment
naming the file:
  vLLM   (vllm-project/vllm) vllm/model_executor/models/qwen3_dflash.py (036a00d1f5d0),
         vllm/config/speculative.py (002e77c1f0ef), vllm/transformers_utils/configs/eagle.py,
         vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (0cfdd2e15d69),
         vllm/v1/spec_decode/llm_base_proposer.py and dflash.py (01046b9a3384)
  SGLang (sgl-project/sglang) python/sglang/srt/models/dflash.py (003b23d7388e),
         python/sglang/srt/speculative/dflash_utils.py and dflash_worker.py
  z-lab  (z-lab/dflash 44947fbf7111, 2026-04-26) dflash/model.py, dflash/model_mlx.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from log_capture import dflash_messages
from safetensors import safe_open
from test_extract import make_config, write_data
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from stage1_extract.run import run_extract
from stage1_extract.target import config_dict
from stage2_train.config import DrafterConfig
from stage2_train.export import export_drafter
from stage2_train.mask_token import mask_token_string
from stage2_train.model import DFlashDrafter, drafter_shape

TAPPED = [0, 1, 2]  # of the tiny target's 4 layers: not the last one (see the last test)
BLOCK = 4

# Read with cfg[key] (a KeyError when absent) by z-lab's MLX load_draft (model_mlx.py), and as
# config attributes by every server's Qwen3-style layers (qwen3_dflash.py, models/dflash.py).
TOP_LEVEL = {
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "intermediate_size": int,
    "vocab_size": int,
    "rms_norm_eps": float,
    "rope_theta": float,  # MLX reads the top-level key, not transformers 5's rope_parameters
    "max_position_embeddings": int,  # vLLM sizes the draft's RoPE cache with it
    "block_size": int,  # z-lab model.py: self.block_size = config.block_size (top level only)
    # z-lab model.py evaluates build_target_layer_ids(config.num_target_layers, ...) even when
    # target_layer_ids is given; SGLang (dflash_utils.parse_dflash_draft_config) without it
    # falls back to the draft's own layer count and refuses the ids past it
    "num_target_layers": int,
}
# dflash_config as the servers read it: vLLM's proposer takes mask_token_id from here only
# (llm_base_proposer._init_parallel_drafting_params, else pard_token/ptd_token_id) and the aux
# layers from target_layer_ids (eagle3_utils); SGLang's parse_dflash_draft_config reads
# block_size, target_layer_ids, mask_token and mask_token_id here first. Any other key changes
# what a server does: causal / use_swa / swa_window_size (vLLM qwen3_dflash.py attention
# mode), use_aux_hidden_state (vLLM drops fc), layer_ids, conv_*, selector_*, ... (SGLang).
DFLASH_KEYS = {"target_layer_ids", "mask_token_id", "block_size", "mask_token"}
# Top-level keys that would make a server read the export otherwise than it was trained:
ABSENT = {
    "eagle_aux_hidden_state_layer_ids",  # vLLM reads it before dflash_config.target_layer_ids
    "target_layer_ids",  # vLLM eagle.py refuses one that differs; SGLang's fallback
    "is_causal",  # vLLM qwen3_dflash.py: true makes every layer causal
    "draft_vocab_size",  # vLLM: another draft vocabulary, mapped by a d2t tensor
    "target_hidden_size",  # vLLM: the fc input width
    "speculators_config",  # vLLM: another config class
    "is_neox_style",  # vLLM / SGLang: false means interleaved RoPE (ours rotates halves)
    "rope_is_neox_style",  # SGLang, likewise
}


@pytest.fixture(scope="module")
def export(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export of a random drafter of the tiny Qwen3 target, as `dflash export` writes it:
    bf16, the target's config as the store keeps it, the mask token's string looked up."""
    target = AutoConfig.from_pretrained(tiny_qwen3)
    stored = config_dict(target)
    mask_id = AutoTokenizer.from_pretrained(tiny_qwen3).mask_token_id
    shape = drafter_shape(
        DrafterConfig(num_layers=2, block_size=BLOCK),
        stored,
        len(TAPPED),
        target.vocab_size,
        mask_id,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("served") / "export"
    mask = mask_token_string({"name_or_path": str(tiny_qwen3)}, mask_id)
    return export_drafter(DFlashDrafter(shape), shape, TAPPED, stored, out, mask_token=mask)


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_config_json_holds_every_key_the_servers_read(export: Path, tiny_qwen3: Path) -> None:
    config = read_config(export)
    for key, kind in TOP_LEVEL.items():
        assert isinstance(config.get(key), kind), (key, config.get(key))
    # vLLM: registry "DFlashDraftModel" -> qwen3_dflash.DFlashQwen3ForCausalLM (eagle.py keeps
    # an architecture that starts with "DFlash"); SGLang: models/dflash.py EntryClass
    # DFlashDraftModel; z-lab's class of the same name. model_type qwen3: AutoConfig gives
    # Qwen3Config in vLLM, SGLang and transformers (z-lab's config_class).
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    dflash = config["dflash_config"]
    assert set(dflash) == DFLASH_KEYS
    assert all(type(i) is int for i in dflash["target_layer_ids"]) and dflash["target_layer_ids"]
    assert dflash["target_layer_ids"] == TAPPED
    assert (
        type(dflash["mask_token_id"]) is int and 0 <= dflash["mask_token_id"] < config["vocab_size"]
    )
    assert (
        dflash["block_size"] == config["block_size"] == BLOCK
    )  # SGLang reads one, z-lab the other
    # SGLang (dflash_worker._resolve_mask_token_id): mask_token is a non-empty string or null
    # (then "<|MASK|>"), and a string in the tokenizer's vocabulary must be mask_token_id's
    vocab = AutoTokenizer.from_pretrained(tiny_qwen3).get_vocab()
    assert isinstance(dflash["mask_token"], str) and dflash["mask_token"]
    assert vocab[dflash["mask_token"]] == dflash["mask_token_id"]
    # SGLang's DFlashMLP refuses another activation; a bias would need bias tensors (vLLM's
    # and SGLang's qkv_proj and o_proj take attention_bias); no rope scaling: training's RoPE
    assert (config["hidden_act"], config["attention_bias"], config["rope_scaling"]) == (
        "silu",
        False,
        None,
    )
    assert not ABSENT & set(config), ABSENT & set(config)


def test_servers_build_a_non_causal_full_attention_qwen3_config(
    export: Path, tiny_qwen3: Path
) -> None:
    config = AutoConfig.from_pretrained(export)  # what vLLM, SGLang and transformers build
    target = AutoConfig.from_pretrained(tiny_qwen3)
    assert type(config).__name__ == "Qwen3Config"
    # vLLM (_resolve_layer_attention) and SGLang (_get_dflash_layer_attention_params): a
    # "sliding_attention" layer is served causal with a window; "full_attention" non-causal,
    # as the block was trained (bidirectional inside a block)
    assert config.layer_types == ["full_attention"] * config.num_hidden_layers
    assert getattr(config, "sliding_window", None) is None
    assert getattr(config, "is_causal", None) is None
    assert config.rope_parameters == {
        "rope_type": "default",
        "rope_theta": target.rope_parameters["rope_theta"],
    }
    # vLLM (DFlashQwen3ForCausalLM): a vocab_size other than the target's means a draft
    # vocabulary mapped by a d2t tensor the export does not have; fc's input is
    # (target_hidden_size or hidden_size) x len(target_layer_ids)
    assert (config.vocab_size, config.hidden_size) == (target.vocab_size, target.hidden_size)
    assert config.max_position_embeddings == target.max_position_embeddings
    # SGLang (DFlashDraftConfig.resolve_target_layer_ids) refuses an id outside this range
    assert config.num_target_layers == target.num_hidden_layers
    assert all(0 <= i < config.num_target_layers for i in config.dflash_config["target_layer_ids"])


def test_tensor_names_shapes_and_dtype_are_what_the_loaders_take(export: Path) -> None:
    """vLLM (DFlashQwen3ForCausalLM.load_weights) prefixes "model." to every name, stacks
    q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj, and refuses a name it does not
    know; SGLang (DFlashDraftModel.load_weights) does the same stacking but skips an unknown
    name silently (that tensor stays random); z-lab's from_pretrained and MLX's strict
    load_weights want exactly these. No embedding or LM head: with them vLLM builds the
    drafter its own (has_own_embed_tokens / has_own_lm_head) instead of the target's."""
    c = read_config(export)
    D, F, E = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, G = c["num_attention_heads"], c["num_key_value_heads"]
    K = len(c["dflash_config"]["target_layer_ids"])
    per_layer = {
        "self_attn.q_proj.weight": (H * E, D),
        "self_attn.k_proj.weight": (G * E, D),
        "self_attn.v_proj.weight": (G * E, D),
        "self_attn.o_proj.weight": (D, H * E),
        "self_attn.q_norm.weight": (E,),
        "self_attn.k_norm.weight": (E,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
        "input_layernorm.weight": (D,),
        "post_attention_layernorm.weight": (D,),
    }
    expected = {
        f"layers.{i}.{name}": shape
        for i in range(c["num_hidden_layers"])
        for name, shape in per_layer.items()
    }
    expected |= {"norm.weight": (D,), "hidden_norm.weight": (D,), "fc.weight": (D, K * D)}
    # MLX globs *.safetensors; vLLM substitutes a mask_embedding.pt for the mask token's row
    assert sorted(p.name for p in export.glob("*.safetensors")) == ["model.safetensors"]
    assert not (export / "mask_embedding.pt").exists()
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        dtypes = {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    assert found == expected
    assert dtypes == {torch.bfloat16}
    assert c["torch_dtype"] == c["dtype"] == "bfloat16"


def test_target_layer_ids_count_from_decoder_layer_outputs(export: Path, tiny_qwen3: Path) -> None:
    """Layer id i is the output of decoder layer i (the residual stream entering layer i + 1),
    not the embedding output for id 0: z-lab model.py reads hidden_states[i + 1]
    (extract_context_feature's offset 1); vLLM taps aux layer i + 1 ("Add 1 to convert
    DFlash's aux layer id semantics", eagle3_utils), captured as the stream entering that
    layer; SGLang captures "before layer i + 1" (dflash_utils.build_target_layer_ids). The
    export's own modeling_dflash.py must read the same stream."""
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3).eval()
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        target.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i in TAPPED
    ]
    try:
        out = target(torch.tensor([[5, 17, 9, 23, 5]]), output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    draft = AutoModel.from_pretrained(export, trust_remote_code=True)
    read = draft.target_features(out.hidden_states)
    assert torch.equal(read, torch.cat([outputs[i] for i in TAPPED], dim=-1))


def test_a_drafter_reading_the_targets_last_layer_is_warned_about(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """Training reads the last layer after the target's final norm (transformers'
    hidden_states[N]); vLLM and SGLang capture a layer as the stream entering the next one
    (qwen3/llama `hidden_states + residual` before each layer, EagleModelMixin in vLLM's
    interfaces.py), so the last layer comes before the final norm there, or not at all."""
    stored = config_dict(AutoConfig.from_pretrained(tiny_qwen3))
    shape = drafter_shape(DrafterConfig(num_layers=1, block_size=BLOCK), stored, 2, 512, 3)
    drafter = DFlashDrafter(shape)
    with dflash_messages() as seen:
        export_drafter(drafter, shape, [0, 2], stored, tmp_path / "below")
    assert not [m for m in seen if "last layer" in m]
    with dflash_messages() as seen:
        export_drafter(drafter, shape, [0, 3], stored, tmp_path / "last")
    [warning] = [m for m in seen if "last layer" in m]
    assert "vLLM and SGLang" in warning and "layers below 3" in warning
    assert "data.tapped_layers=[0]" in warning
    assert json.loads((tmp_path / "last" / "config.json").read_text())["dflash_config"][
        "target_layer_ids"
    ] == [0, 3]  # written all the same: transformers serves it as trained
    # export-best exports the same layout at every improvement: one warning a run
    with dflash_messages() as seen:
        export_drafter(drafter, shape, [0, 3], stored, tmp_path / "again")
    assert not [m for m in seen if "last layer" in m]


def test_extract_warns_before_tapping_the_targets_last_layer(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """The same warning comes from extract, before the store is written (hours at 8B), not
    only from the export at the end of training; a store below the last layer gets none."""
    data = write_data(tmp_path)
    with dflash_messages() as seen:
        run_extract(make_config(tiny_qwen3, data, tmp_path / "below", "target.tapped_layers=[0,2]"))
    assert not [m for m in seen if "last layer" in m]
    with dflash_messages() as seen:
        run_extract(make_config(tiny_qwen3, data, tmp_path / "last", "target.tapped_layers=[1,3]"))
    [warning] = [m for m in seen if "last layer" in m]
    assert warning.startswith("target.tapped_layers:") and "vLLM and SGLang" in warning
