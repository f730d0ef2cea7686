"""The exported drafter's positions and rope for targets with rope scaling, checked against
transformers' own config classes (tiny sizes, built locally).

The drafter's rope is its own (Q and K are its projections): plain RoPE at the theta of the
target's full-attention layers, the same in training, in config.json and in the servers that
build it from config.json. What it takes from the target is the position limit, which for
Gemma 3 (4B and up: linear scaling x8 on the full-attention layers) is max_position_embeddings
as it stands, 131072: that number already is the scaled length."""

from __future__ import annotations

from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, Qwen3Config

from stage1_extract.target import config_dict, max_positions
from stage2_train.config import DrafterConfig
from stage2_train.model import drafter_config_json, drafter_shape

SIZES = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 6,
    "rms_norm_eps": 1e-6,
}
LINEAR_X8 = {"rope_type": "linear", "factor": 8.0}


def gemma3_configs() -> list[object]:
    """Gemma 3 (4B+) as transformers 5 builds it, as extract stores it (text-only and
    multimodal), and as a transformers 4 config.json keeps it (rope_scaling, rope_theta)."""
    text = Gemma3TextConfig(**SIZES, rope_scaling=LINEAR_X8)
    assert text.max_position_embeddings == 131072  # transformers' default, as in the hub's
    assert text.rope_parameters["full_attention"] == {**LINEAR_X8, "rope_theta": 1e6}
    t4 = {
        **SIZES,
        "model_type": "gemma3_text",
        "max_position_embeddings": 131072,
        "rope_scaling": LINEAR_X8,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
    }
    return [
        text,
        config_dict(text),
        config_dict(Gemma3Config(text_config=text)),
        t4,
        {"model_type": "gemma3", "text_config": {**t4, "model_type": "gemma3_text"}},
    ]


def test_gemma3_limit_is_its_max_position_embeddings() -> None:
    for config in gemma3_configs():
        found = max_positions(config)  # type: ignore[arg-type]
        assert found == (131072, "max_position_embeddings"), config
    # elsewhere linear scaling without an original length still multiplies (vicuna-16k's
    # 4096 x 4), as vLLM takes it
    vicuna = LlamaConfig(max_position_embeddings=4096, rope_scaling={**LINEAR_X8, "factor": 4.0})
    assert max_positions(vicuna).limit == 16384


def test_gemma3_drafter_exports_its_limit_and_the_full_attention_rope() -> None:
    for target in gemma3_configs():
        stored = target if isinstance(target, dict) else config_dict(target)
        shape = drafter_shape(DrafterConfig(num_layers=1, block_size=4), stored, 3, 50, 49)
        config = drafter_config_json(shape, [1, 2, 3], stored)
        assert config["max_position_embeddings"] == 131072
        assert (config["rope_theta"], config["rope_scaling"]) == (1e6, None)
        # read back as z-lab's loader and the servers read it: the plain RoPE it trained with
        served = Qwen3Config(**{k: v for k, v in config.items() if k != "dflash_config"})
        assert served.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
        assert served.max_position_embeddings == 131072
