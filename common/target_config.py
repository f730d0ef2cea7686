"""The target's decoder config, read the same way by extract, train and export.

A target's config comes as a transformers config (extract, evaluate) or as the JSON dict the
store keeps (`target.config`, read by train and export). Multimodal targets (Gemma 3,
Qwen2.5-VL, Llama 4, Mistral 3...) nest the decoder's settings under `text_config`: an object,
or a plain dict in the stored JSON and in configs built without the sub-config's class (remote
code). `text_config` gives the decoder's settings as attributes from any of these shapes:

    text = text_config(config)          # PretrainedConfig, SimpleNamespace or stored dict
    getattr(text, "hidden_size", None)  # a field the config may lack
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def text_config(config: Any) -> Any:
    """The decoder's config with its fields as attributes: `config` itself, or its nested
    text config (object or dict); a dict (the stored JSON, or a nested one) as a namespace."""
    if isinstance(config, dict):
        config = SimpleNamespace(**config)
    if hasattr(config, "get_text_config"):
        text = config.get_text_config(decoder=True)  # gives a nested dict back as it is
    else:
        text = getattr(config, "text_config", None) or config
    return SimpleNamespace(**text) if isinstance(text, dict) else text


def last_layer_tapped_note(tapped_layers: list[int], num_layers: int | None) -> str | None:
    """Why tapping the target's last layer costs at serving time, or None when it is not tapped.

    Training (and transformers, the export's modeling_dflash.py, z-lab's code) take layer N-1 as
    hidden_states[N], after the final norm, while vLLM and SGLang tap layer i as the residual
    stream entering layer i + 1, which for the last layer they give before the final norm or not
    at all; every other layer reads the same everywhere. Extract says it before the store is
    written, export again beside the drafter it concerns."""
    if num_layers is None or num_layers - 1 not in tapped_layers:
        return None
    below = [i for i in tapped_layers if i < num_layers - 1]
    return (
        f"the drafter reads the target's last layer ({num_layers - 1} of tapped layers "
        f"{list(tapped_layers)}), after the target's final norm (transformers' hidden_states"
        f"[{num_layers}]); vLLM and SGLang give that layer before the final norm, or not at "
        "all, so there it drafts from other features than it learned. Serve it with "
        "transformers (the export's modeling_dflash.py), or for vLLM and SGLang tap layers "
        f"below {num_layers - 1} only (data.tapped_layers={below} trains on those of a store)"
    )
