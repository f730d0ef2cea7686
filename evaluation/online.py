"""`dflash evaluate`: online acceptance length of a trained drafter against prompt lookup.

Loads the target (its embedding and LM head serve the drafter, as at serving time), takes
the first `prompt_tokens` tokens of the first `num_prompts` documents of a text dataset as
prompts, and generates `new_tokens` greedily with each drafter; prints tau per method.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.logging import get_logger
from evaluation.acceptance import (
    TappedTarget,
    dflash_draft_fn,
    measure_acceptance,
    prompt_lookup_draft,
)


@dataclass
class EvaluateConfig:
    target: str
    data: str
    drafter: str | None = None
    num_prompts: int = 12
    prompt_tokens: int = 256
    new_tokens: int = 128
    device: str = "cpu"
    dtype: str = "float32"
    text_field: str = "text"


def _chat_prompt(tokenizer, messages: list[dict], limit: int) -> list[int]:
    """The conversation up to its last assistant turn, through the chat template with the
    generation prompt: what a server sees before the model answers. Truncated from the left so
    the generation prompt stays."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    history = messages[:last] if last is not None else messages
    rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return ids[-limit:]


def load_prompts(cfg: EvaluateConfig, tokenizer) -> list[list[int]]:
    """Prompts from text rows (their first tokens) or chat rows (`messages`, up to the last
    assistant turn, rendered by the target's chat template)."""
    import datasets

    path = Path(cfg.data)
    if not path.exists():
        raise ValueError(f"--data {path} does not exist; pass a .json/.jsonl(.gz) of documents")
    rows = datasets.load_dataset("json", data_files=str(path), split="train")
    rows = rows.select(range(min(cfg.num_prompts, len(rows))))
    if "messages" in rows.column_names:
        if not tokenizer.chat_template:
            raise ValueError(
                f"{path} holds conversations but the target's tokenizer has no chat template"
            )
        return [_chat_prompt(tokenizer, m, cfg.prompt_tokens) for m in rows["messages"]]
    if cfg.text_field not in rows.column_names:
        raise ValueError(
            f"{path}: no column {cfg.text_field!r} or 'messages' (found {rows.column_names})"
        )
    return [tokenizer(text)["input_ids"][: cfg.prompt_tokens] for text in rows[cfg.text_field]]


def run_evaluate(cfg: EvaluateConfig) -> dict:
    """Measure tau for prompt lookup and, when given, the DFlash drafter; return the figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stage2_train.export import load_export, read_export_config

    log = get_logger()
    dtype = getattr(torch, cfg.dtype)
    # the drafter first: a wrong folder fails before minutes of prompt lookup
    drafter = load_export(cfg.drafter).to(cfg.device, dtype).eval() if cfg.drafter else None
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(cfg.device).eval()
    prompts = load_prompts(cfg, tokenizer)
    results: dict = {"num_prompts": len(prompts), "new_tokens": cfg.new_tokens}

    lookup = measure_acceptance(
        TappedTarget(model, None),
        prompts,
        lambda toks, _: prompt_lookup_draft(toks, 15),
        cfg.new_tokens,
    )
    results["prompt_lookup"] = {"tau": lookup.tau, "tau_per_prompt": lookup.tau_per_prompt}
    log.info("prompt lookup: tau %.3f", lookup.tau)

    if drafter is not None:
        tapped = read_export_config(cfg.drafter)["dflash_config"]["target_layer_ids"]
        draft = dflash_draft_fn(
            drafter,
            model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach(),
        )
        dflash = measure_acceptance(TappedTarget(model, tapped), prompts, draft, cfg.new_tokens)
        results["dflash"] = {"tau": dflash.tau, "tau_per_prompt": dflash.tau_per_prompt}
        log.info("dflash: tau %.3f", dflash.tau)
    return results
