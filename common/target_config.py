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
