"""`dflash evaluate`: online acceptance length of a trained drafter against prompt lookup.

Loads the target (its embedding and LM head serve the drafter, as at serving time), takes
the first `prompt_tokens` tokens of the first `num_prompts` documents of a text dataset as
prompts, and generates `new_tokens` with each drafter (target KV cache, drafter
context cache: evaluation.acceptance), greedily or sampled at a temperature (keyed draws: every
method meets the same sampled text). Returns tau per method, acceptance by draft position
and the histogram of accepted tokens per forward; `plot` also draws them (evaluation.plot).
Every prompt with its `new_tokens` must fit the target's positions (check_positions, before
the weights load); drafts are cut at that limit as a server cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.logging import get_logger
from common.target_config import text_config
from evaluation.acceptance import (
    AcceptanceResult,
    CachedTarget,
    Sampling,
    TokenPicker,
    measure_acceptance,
    prompt_lookup_draft,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from stage1_extract.target import MaxPositions
    from stage2_train.model import DFlashDrafter

# Prompt lookup drafts as many tokens as a block of this size holds, unless a drafter is given
# (then its own block size, so both are compared at the same draft length).
DEFAULT_BLOCK_SIZE = 16
# Below this width a target on the CPU runs with one intra-op thread (see run_evaluate).
SMALL_HIDDEN = 512


@dataclass
class EvaluateConfig:
    target: str  # target model folder or hub id
    data: str  # .json/.jsonl(.gz)/.parquet file or folder: `text` documents or `messages` chats
    drafter: str | None = None  # exported drafter folder; None: prompt lookup only
    num_prompts: int = 12  # the first N rows of `data`
    prompt_tokens: int = 256  # prompt length (text: first tokens; chat: last tokens)
    new_tokens: int = 128  # tokens generated per prompt, at most
    device: str = "cpu"
    dtype: str = "float32"
    text_field: str = "text"
    plot: str | None = None  # PNG of acceptance by draft position; None: no plot
    # end a reply at the target's end of sequence (for chat: its end of turn), as a server
    # does; False decodes new_tokens past it (the shared harness's definition)
    stop_at_eos: bool = True
    # passed to the chat template (prompts and its end of turn), e.g. {"enable_thinking": False}
    # for Qwen3: as `dflash generate` wrote the training replies
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # 0: the target's argmax (greedy verification); above: a draw at that temperature from the
    # top_k most likely tokens (0: all), cut to their top_p nucleus, keyed by (seed, prompt,
    # token index) (evaluation.acceptance.Sampling)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    num_seeds: int = 1  # sampled: each prompt under seeds seed .. seed + num_seeds - 1
    repetition_penalty: float = 1.0  # greedy or sampled: as transformers and vLLM apply it

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            self.temperature,
            self.top_p,
            self.seed,
            self.num_seeds,
            self.top_k,
            self.repetition_penalty,
        )

    def validate(self) -> None:
        # named by their flags, as evaluate-offline names its own (the fields' names are not
        # what the user typed)
        problems = [
            f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}"
            for name, low in (("num_prompts", 1), ("prompt_tokens", 1), ("new_tokens", 2))
            if getattr(self, name) < low
        ]
        problems += self.sampling.problems()
        if problems:
            raise ValueError("invalid evaluate settings: " + "; ".join(problems))


def _chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], template_kwargs: dict[str, Any]
) -> list[int]:
    """The conversation before the reply a server would write next, through the chat template
    with the generation prompt: without its final assistant turn when it ends with one (the
    dataset's reply), else all of it (a pending user turn is what the model answers)."""
    ends_with_reply = bool(messages) and messages[-1].get("role") == "assistant"
    history = messages[:-1] if ends_with_reply else messages
    rendered = tokenizer.apply_chat_template(
        history, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def load_prompts(cfg: EvaluateConfig, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Prompts from text rows (their first tokens) or chat rows (`messages`, up to the last
    assistant turn, rendered by the target's chat template)."""
    from stage1_extract.chat import InvalidRow, template_message
    from stage1_extract.data import special_affixes, without_suffix
    from stage1_extract.data_files import load_local

    path = Path(cfg.data)
    if not path.exists():
        raise ValueError(
            f"--data {path} does not exist; pass a .json/.jsonl(.gz)/.parquet file of "
            "documents or conversations, or a folder of them"
        )
    if (path / "zarr.json").is_file():
        # the reader took the store's zarr.json files for rows and failed in a pyarrow cast
        raise ValueError(
            f"--data {path} is a store (zarr.json), not prompts: pass the rows it was "
            "extracted from (a .jsonl, or the `dflash generate` folder), or measure on the "
            "store with `dflash evaluate-offline --store`"
        )
    # extract's reader: the same files and folders (a `dflash generate` output too), and a
    # malformed line or an empty file named with the fix
    rows = load_local(path, "train")
    if len(rows) < cfg.num_prompts:
        # the figures' num_prompts says it, but a reader compares tau over the count asked for
        get_logger().warning(
            "--num-prompts %d asks for more prompts than --data %s has (%d rows): all %d are used",
            cfg.num_prompts,
            path,
            len(rows),
            len(rows),
        )
    rows = rows.select(range(min(cfg.num_prompts, len(rows))))
    if "messages" in rows.column_names:
        if not tokenizer.chat_template:
            raise ValueError(
                f"{path} holds conversations but the target's tokenizer has no chat template"
            )
        prompts, cut = [], 0
        for i, raw in enumerate(rows["messages"]):
            try:
                # as extract renders them: parts joined, Arrow's None-filled keys dropped (a
                # template testing `tool_calls is defined` took a None for a list)
                messages = [template_message(m, j, "messages") for j, m in enumerate(raw or [])]
            except InvalidRow as err:
                raise ValueError(
                    f"--data {path} row {i}: {err.detail}; fix or remove the row"
                ) from None
            try:
                ids = _chat_prompt(tokenizer, messages, cfg.chat_template_kwargs)
            except Exception as err:  # the template's raise_exception, or a Jinja error
                raise ValueError(
                    f"--data {path} row {i}: the chat template failed ({err}); fix or remove "
                    "the row (a conversation needs a user turn before its last assistant turn)"
                ) from err
            cut += len(ids) > cfg.prompt_tokens
            prompts.append(ids[-cfg.prompt_tokens :])  # from the left: the generation prompt stays
        if cut:
            get_logger().warning(
                "%d of %d chat prompts cut to their last %d tokens (--prompt-tokens): the start "
                "of those conversations (a system prompt, say) is not in the prompt",
                cut,
                len(prompts),
                cfg.prompt_tokens,
            )
    elif cfg.text_field not in rows.column_names:
        raise ValueError(
            f"--data {path}: no column {cfg.text_field!r} or 'messages' (found "
            f"{rows.column_names}); pass rows of plain text in 'text' or conversations in "
            "'messages' [{role, content}]"
        )
    else:
        # the tokenizer's BOS stays, an EOS it appends goes (add_eos_token): it would tell the
        # target a short document had ended, where extract stores the text without it
        suffix = special_affixes(tokenizer)[1]
        prompts = [
            without_suffix(tokenizer(text or "")["input_ids"], suffix)[: cfg.prompt_tokens]
            for text in rows[cfg.text_field]
        ]
    # an empty prompt has nothing to prefill: the target would fail deep inside its forward,
    # after minutes of prompt lookup on the rows before it
    empty = [i for i, prompt in enumerate(prompts) if not prompt]
    if empty:
        raise ValueError(
            f"--data {path} row {empty[0]}: the prompt is empty (no tokens); remove the row or "
            "give it text"
        )
    return prompts


def check_drafter_fits(
    drafter_config: dict[str, Any], target_config: Any, cfg: EvaluateConfig
) -> None:
    """Refuse a drafter trained for another target: its input is the target's tapped hidden
    states and it drafts through the target's embedding and LM head, so another width fails
    deep in the first draft (after all of prompt lookup) and another vocabulary drafts ids
    that mean other tokens, without an error."""
    text = text_config(target_config)
    problems = []
    if drafter_config["hidden_size"] != text.hidden_size:
        problems.append(f"hidden size {drafter_config['hidden_size']} vs {text.hidden_size}")
    if drafter_config["vocab_size"] != text.vocab_size:
        problems.append(f"vocab {drafter_config['vocab_size']} vs {text.vocab_size}")
    layers = drafter_config["dflash_config"]["target_layer_ids"]
    if max(layers) >= text.num_hidden_layers:
        problems.append(f"it reads layers {layers} of a target with {text.num_hidden_layers}")
    if problems:
        raise ValueError(
            f"--drafter {cfg.drafter} was not trained for --target {cfg.target}: "
            + "; ".join(problems)
            + "; pass the target whose store trained the drafter, or a drafter trained on "
            "this target's store"
        )


def check_positions(
    cfg: EvaluateConfig, found: MaxPositions | None, prompts: list[list[int]] | None = None
) -> None:
    """Refuse what would run the target past its positions (`found`; None: its config names
    none): a rotary model runs on there without an error, out of what it was trained on, and
    tau would be measured on that. First --new-tokens alone, then each prompt with its reply
    (a server's rule: prompt + max tokens within its max length). A long prompt is refused,
    not cut: --prompt-tokens is the one rule that cuts prompts, the same for every prompt, and
    the message names the value that fits."""
    if found is None:
        return
    limit, new = found.limit, cfg.new_tokens
    where = f"{cfg.target}'s {found.source} ({limit})"
    if new >= limit:
        raise ValueError(
            f"--new-tokens {new} leaves no room for a prompt within {where}: every prompt with "
            f"its reply would run past them; lower --new-tokens below {limit}"
        )
    long = [i for i, prompt in enumerate(prompts or []) if len(prompt) + new > limit]
    if long:
        others = len(long) - 1
        more = f" (and {others} more prompt{'s' * (others > 1)})" if others else ""
        raise ValueError(
            f"--data {cfg.data} row {long[0]}: the prompt has {len(prompts[long[0]])} tokens, "
            f"which with --new-tokens {new} exceed {where}{more}; pass --prompt-tokens "
            f"{limit - new} or lower (every prompt cut to that many tokens), or lower --new-tokens"
        )


def reply_stop_ids(model: torch.nn.Module, tokenizer: Any, template_kwargs: dict) -> frozenset[int]:
    """The ids that end a reply, as `dflash generate` stops: the tokenizer's and the generation
    config's end of sequence, and the chat template's end-of-turn token."""
    from stage1_generate.rows import stop_token_ids

    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    try:
        return frozenset(stop_token_ids(tokenizer, eos, template_kwargs))
    except ValueError as err:
        raise ValueError(f"{err}; or pass --no-stop-at-eos") from err


def run_evaluate(cfg: EvaluateConfig) -> dict:
    """Measure tau for prompt lookup and, when given, the DFlash drafter; return the figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stage1_extract.config import TargetConfig
    from stage1_extract.fingerprints import weights_fingerprint
    from stage1_extract.target import load_target_config, max_positions
    from stage2_train.export import load_export, other_target, read_export_config

    cfg.validate()
    if cfg.sampling.greedy and (
        cfg.top_p != 1 or cfg.top_k != 0 or cfg.seed != 0 or cfg.num_seeds != 1
    ):
        # the argmax takes no draw: a --top-p, --top-k or --seed without --temperature changes
        # nothing, and every seed would decode the same text (one is run)
        get_logger().warning(
            "--top-p %s / --top-k %s / --seed %s / --num-seeds %s have no effect at "
            "--temperature 0 (greedy: each prompt decoded once): pass --temperature T > 0 to "
            "sample",
            cfg.top_p,
            cfg.top_k,
            cfg.seed,
            cfg.num_seeds,
        )
    dtype = getattr(torch, cfg.dtype)
    # the target's positions from its config alone, and the prompts, before any weights load
    # (a missing folder or an unreachable hub id is named with the fix)
    target_config = load_target_config(TargetConfig(model=cfg.target), "--target")
    if getattr(target_config, "dflash_config", None) is not None:
        # a drafter export loads as a model too: refused here, its check against the drafter
        # named its layers and width as if it were a target of another shape
        raise ValueError(
            f"--target {cfg.target} is a DFlash drafter export (dflash_config in its "
            "config.json), not a target: pass the target model the drafter was trained for "
            "as --target, and the export as --drafter"
        )
    found = max_positions(target_config)
    check_positions(cfg, found)
    # the drafter first: a wrong folder, or one of another target, fails before minutes of
    # prompt lookup
    if cfg.drafter:
        drafter_config = read_export_config(cfg.drafter)
        check_drafter_fits(drafter_config, target_config, cfg)
        # the same shapes of another model (a base beside its instruct twin) fit: said, not
        # refused, as a quantized deployment of the trained-for target is another file too
        if differs := other_target(drafter_config, cfg.target, weights_fingerprint(cfg.target)):
            get_logger().warning(
                "--drafter %s was %s: tau is measured on another target than it learned",
                cfg.drafter,
                differs,
            )
    drafter = load_export(cfg.drafter).to(cfg.device, dtype).eval() if cfg.drafter else None
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    prompts = load_prompts(cfg, tokenizer)
    check_positions(cfg, found, prompts)
    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(cfg.device).eval()
    threads, width = torch.get_num_threads(), text_config(model.config).hidden_size
    if torch.device(cfg.device).type == "cpu" and width < SMALL_HIDDEN:
        # A toy target's matrices are too small to split across threads, and on a shared CPU
        # threads waiting for one another cost far more: the tiny example took 5 min with
        # 2 threads on 2 busy cores, 19 s with one.
        torch.set_num_threads(1)
    try:
        return _evaluate(cfg, model, tokenizer, drafter, prompts)
    finally:
        torch.set_num_threads(threads)


def _evaluate(
    cfg: EvaluateConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    drafter: DFlashDrafter | None,
    prompts: list[list[int]] | None = None,
) -> dict:
    """Both methods on the loaded target (run_evaluate's body, under its thread setting);
    `prompts`: load_prompts' (None: loaded here)."""
    from evaluation.dflash_draft import dflash_draft_fn
    from stage1_extract.target import max_positions
    from stage2_train.export import read_export_config

    log = get_logger()
    found = max_positions(model.config)
    if prompts is None:
        prompts = load_prompts(cfg, tokenizer)
    check_positions(cfg, found, prompts)
    limit = found.limit if found else None
    num_draft = (drafter.shape.block_size if drafter else DEFAULT_BLOCK_SIZE) - 1
    stop_ids = (
        reply_stop_ids(model, tokenizer, cfg.chat_template_kwargs)
        if cfg.stop_at_eos
        else frozenset()
    )
    results: dict = {
        "num_prompts": len(prompts),
        "new_tokens": cfg.new_tokens,
        "num_draft": num_draft,
        # a boolean, and the ids in their own field ([] when off): one field of two types
        # (the ids, or False) had readers test its truth where they meant either
        "stop_at_eos": cfg.stop_at_eos,
        "stop_ids": sorted(stop_ids),
        "sampling": cfg.sampling.to_json(),
    }

    def lookup_draft(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        return prompt_lookup_draft(tokens, num_draft)

    lookup = measure_acceptance(
        CachedTarget(model, None, TokenPicker(cfg.sampling)),
        prompts,
        lambda: lookup_draft,
        cfg.new_tokens,
        num_draft,
        desc="prompt lookup",
        stop_ids=stop_ids,
        max_positions=limit,
    )
    if not lookup.tau_per_prompt:
        raise ValueError(
            f"--data {cfg.data}: the target ended every reply at once (its end-of-sequence "
            "token first), so no draft was verified; pass prompts it continues, or "
            "--no-stop-at-eos to decode past the end"
        )
    if lookup.ended_at_prefill:
        log.info(
            "prompts %s left out of tau: the target's reply was its end of sequence alone",
            lookup.ended_at_prefill,
        )
    results["prompt_lookup"] = lookup.to_json()
    log.info("prompt lookup: %s", _tau_line(lookup))

    if drafter is not None:
        tapped = read_export_config(cfg.drafter)["dflash_config"]["target_layer_ids"]
        embed_VD = model.get_input_embeddings().weight.detach()
        head_VD = model.get_output_embeddings().weight.detach()
        dflash = measure_acceptance(
            CachedTarget(model, tapped, TokenPicker(cfg.sampling)),
            prompts,
            lambda: dflash_draft_fn(drafter, embed_VD, head_VD),
            cfg.new_tokens,
            num_draft,
            desc="dflash",
            stop_ids=stop_ids,
            max_positions=limit,
        )
        results["dflash"] = dflash.to_json()
        log.info("dflash: %s", _tau_line(dflash))
    if cfg.plot:
        try:
            from evaluation.plot import plot_acceptance
        except ImportError as err:  # the figures above are worth more than their plot
            log.warning("no plot (%s): pip install matplotlib, or drop --plot/--json-out", err)
        else:
            path = plot_acceptance(results, cfg.plot)
            log.info("plot of acceptance by draft position: %s", path)
    return results


def _tau_line(result: AcceptanceResult) -> str:
    """tau and speed for the log, with each seed's tau when several ran (a sampled tau on a
    dozen prompts moves 10-30% between seeds: the spread says how far to trust the mean)."""
    line = f"tau {result.tau:.3f} ({result.new_tokens / result.seconds:.1f} tokens/s)"
    if len(result.tau_per_seed) > 1:
        line += ", per seed " + " / ".join(f"{tau:.3f}" for tau in result.tau_per_seed)
    return line
