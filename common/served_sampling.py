"""The sampling a server applies to a request that sets none (`--server-sampling` of `dflash
evaluate` and `dflash generate`).

vLLM (`--generation-config auto`, its default) and SGLang (`--sampling-defaults model`) fill a
request's missing sampling parameters from the target's generation_config.json, where it sets
them apart from transformers' defaults: Qwen3's temperature 0.6, top_p 0.95, top_k 20. What
it does not set falls to the server's own defaults: temperature 1.0, every token. So a team
whose clients send no sampling parameters is served at those settings, and its drafter's tau
is the tau at those settings.

Of what the servers fill, min-p is not modelled by `dflash evaluate`: a generation config
that sets it is warned of by name, as the measured tau is then not quite the served one.

This is vLLM's reading (`ModelConfig.get_diff_sampling_param`: `to_diff_dict`). SGLang's
`get_default_sampling_params` reads `to_dict()` instead: under transformers 4, whose
GenerationConfig defaults are set (top_k 50), it also fills top_k 50 where the file sets no
top_k (sgl-project/sglang#11574). And SGLang's repetition penalty counts the reply's tokens
only, not the prompt's; vLLM's and transformers' (modelled here) count both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.logging import get_logger

# a server's own defaults for what neither the request nor the generation config sets
SERVER_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
}
# filled from the generation config by the servers too, but not modelled by evaluate's draws,
# with the value at which it changes nothing (vLLM applies min-p between the temperature and
# top-k, transformers after top-p: no one order to model)
UNMODELLED = {"min_p": 0.0}


def served_sampling(target: str) -> dict[str, Any]:
    """temperature, top_p, top_k and repetition_penalty as a server samples `target` for a
    request that sets none: its generation_config.json's where set, else the servers'
    defaults. A hub target whose generation config is not in the local cache is taken to set
    none, with a warning."""
    from transformers import GenerationConfig

    try:
        # to_diff_dict: what the file sets apart from transformers' defaults, as vLLM reads it
        found = GenerationConfig.from_pretrained(target).to_diff_dict()
    except OSError:
        if not Path(target).expanduser().is_dir():  # a hub id (a folder may have no such file)
            get_logger().warning(
                f"--target {target}: its generation_config.json is not in the local hub cache "
                "(HF_HUB_OFFLINE, or the hub unreachable): --server-sampling assumes it sets "
                "no sampling (temperature 1.0, every token); fetch it first (`hf download "
                f"{target} generation_config.json`) to measure at the settings it sets"
            )
        found = {}
    served = dict(SERVER_DEFAULTS)
    for key in served:
        if found.get(key) is not None:
            served[key] = found[key]
    served["top_k"] = max(int(served["top_k"]), 0)  # -1 and 0 both mean every token
    unmodelled = {
        key: found[key]
        for key, neutral in UNMODELLED.items()
        if found.get(key) is not None and found[key] != neutral
    }
    if unmodelled:
        settings = ", ".join(f"{key} {value}" for key, value in unmodelled.items())
        get_logger().warning(
            f"--target {target}: its generation_config.json sets {settings}, which a server "
            "applies to a request that sets none and `dflash evaluate` does not model: the "
            "tau measured is at its temperature, top-p, top-k and repetition penalty alone"
        )
    return served


def log_served(values: dict[str, Any]) -> None:
    """Say which sampling --server-sampling settled on (`values` holds SERVER_DEFAULTS' keys,
    after the flags given beside it)."""
    get_logger().info(
        "--server-sampling: temperature %s, top-p %s, top-k %s, repetition penalty %s",
        *(values[key] for key in SERVER_DEFAULTS),
    )
