"""The local backend of `dflash generate`: transformers' `generate` with a KV cache, batched.

Prompts are sorted by length and cut into batches of at most `batch_size` prompts and
`batch_tokens` (prompt + new) tokens, left-padded, so a batch wastes little padding and its
KV cache stays bounded. Generation stops at the stop ids (the tokenizer's end of sequence and
the chat template's end-of-turn token); the stop id itself is not part of the reply, any other
special token the target wrote is, as its text (e.g. Llama 3.1's `<|python_tag|>`).

Legend: B batch rows, T prompt length (padded), N new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from common.logging import get_logger
from stage1_extract.target import max_positions
from stage1_generate.config import SamplingConfig
from stage1_generate.penalty import PaddedRepetitionPenalty
from stage1_generate.preallocated_cache import cache_kwargs, unsupported_reason

KV_CACHES = ("auto", "dynamic", "static", "preallocated")
# what a target's generation_config.json keeps when generate runs: its special token ids, the
# KV cache it names (a sliding-window model's own) and what it returns, nothing that shapes
# the logits
GENERATION_KEPT = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "cache_implementation",
    "cache_config",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
)


@dataclass
class Completion:
    """One reply: its text, its token ids when the backend knows them, whether it ended at a
    stop id (False: cut at the token limit), and which stop id ended it (None when cut, or
    when a server did not say which). Neither text, ids nor num_tokens hold the stop id; a
    reply cut inside a character is stored without it (`rows.whole_characters`: text and ids),
    num_tokens still counting its tokens."""

    text: str
    num_tokens: int
    finished: bool
    token_ids: list[int] | None = None
    stop_id: int | None = None


def plan_batches(
    lengths: list[int], max_new: int, batch_size: int, batch_tokens: int, min_row: int = 0
) -> list[list[int]]:
    """Indices of the prompts, longest first, grouped so that each group holds at most
    `batch_size` prompts and max(longest prompt + max_new, min_row) x rows <= batch_tokens (one
    prompt always fits). `min_row`: the cache length of a row whatever the group's prompts (a
    static cache is as long as the longest row the model has generated)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max((lengths[current[0]] if current else lengths[i]) + max_new, min_row)
        if current and (len(current) >= batch_size or width * (len(current) + 1) > batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def plain_generation_config(model: torch.nn.Module) -> None:
    """Give `model` a generation config of its special token ids and named KV cache alone. A
    target's generation_config.json may set sampling defaults (Qwen2.5-Instruct's repetition penalty
    1.05, top_k, min_p ...) that `generate` would apply on top of ours: the rows would then not
    be the target's argmax, the text a greedy-verified drafter must predict, nor the
    configured sampling. Said once in the log when it drops anything."""
    own = getattr(model, "generation_config", None)
    own_diff = own.to_diff_dict() if own is not None else {}
    kept = {k: own_diff[k] for k in GENERATION_KEPT if k in own_diff}
    dropped = {
        k: v
        for k, v in own_diff.items()
        if k not in kept and k != "transformers_version" and not k.startswith("_")
    }
    if dropped:
        get_logger().info(
            f"the target's generation_config sets {dropped}: not applied (the rows follow "
            "sampling.* alone; greedy is the target's argmax)"
        )
    model.generation_config = GenerationConfig(**kept)


class StepTicker(StoppingCriteria):
    """Stops nothing: calls `note(batch, batches, rows, step, max_new)` after a decode step, at
    most every `every_s` seconds. A batch runs all its steps inside transformers' `generate`,
    which took minutes on a CPU (pystd-28m, 2 cores: 43 s to 4 min a batch) with the bar still."""

    def __init__(
        self,
        note: Callable[[int, int, int, int, int], None],
        batch: tuple[int, int],
        width: int,
        max_new: int,
        every_s: float = 0.5,
    ) -> None:
        self.note, self.batch, self.width, self.max_new = note, batch, width, max_new
        self.every_s, self.shown = every_s, 0.0
        self.never_B: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.never_B is None:  # one tensor for every step: no allocation per token
            self.never_B = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
        if time.monotonic() - self.shown >= self.every_s:
            self.shown = time.monotonic()
            self.note(*self.batch, len(input_ids), input_ids.shape[1] - self.width, self.max_new)
        return self.never_B


class LocalBackend:
    """Greedy or sampled generation from a loaded causal LM on one device. `on_step`, when
    set: `StepTicker`'s note of the batch under way (the progress bar's)."""

    on_step: Callable[[int, int, int, int, int], None] | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingConfig,
        stop_ids: list[int],
        batch_size: int,
        batch_tokens: int,
        kv_cache: str = "auto",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
        # static: transformers' StaticCache, which its generate compiles on a GPU. It sizes every
        # cache to the longest (prompt + new) generated on the model so far (one compiled shape),
        # not to the batch's own: rows are planned by that length (`static_row`), so that
        # batch_tokens bounds the cache as it bounds the growing one
        self.static = kv_cache == "static"
        self.cache_kwargs = {"cache_implementation": "static"} if self.static else {}
        # preallocated: a dynamic cache whose layers are allocated at the batch's final length
        # (stage1_generate/preallocated_cache.py), a new one per batch; auto picks it wherever
        # the target allows (the same replies, no per-step copy of the whole cache)
        reason = unsupported_reason(model) if kv_cache in ("auto", "preallocated") else None
        if kv_cache == "preallocated" and reason is not None:
            raise ValueError(
                f"run.kv_cache=preallocated cannot serve this target: {reason}; "
                "use run.kv_cache=dynamic or auto"
            )
        if kv_cache == "auto":
            kv_cache = "dynamic" if reason else "preallocated"
            if reason:
                get_logger().info(f"run.kv_cache=auto: the dynamic KV cache, since {reason}")
        self.kv_cache = kv_cache  # the cache that runs (auto resolved)
        self.preallocated = kv_cache == "preallocated"
        self.static_row = 0
        self.device = next(model.parameters()).device
        found = max_positions(model.config)  # as extract checks packing.seq_len against
        self.max_positions = found.limit if found else None
        self.max_positions_source = f"the target's {found.source}" if found else "none"
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else stop_ids[0]
        plain_generation_config(model)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        on_batch: Callable[[int, int], None] | None = None,
        stop: bool = True,
    ) -> list[Completion]:
        """Replies to `prompts` (token ids), in their order. `on_batch(prompts, new_tokens)`
        is called after each batch (progress). `stop` false: every reply runs to
        `max_new_tokens`, past the stop ids, which its text then writes out as any other
        special token."""
        out: list[Completion | None] = [None] * len(prompts)
        lengths = [len(p) for p in prompts]
        min_row = 0
        if self.static and lengths:  # transformers' own record too (another caller's batches)
            seen = getattr(self.model, "_previous_max_cache_length", 0) + 1
            self.static_row = max(self.static_row, seen, max(lengths) + max_new_tokens)
            min_row = self.static_row
        planned = plan_batches(lengths, max_new_tokens, self.batch_size, self.batch_tokens, min_row)
        for k, batch in enumerate(planned):
            rows = self._generate_batch(
                [prompts[i] for i in batch], max_new_tokens, stop, (k + 1, len(planned))
            )
            for i, completion in zip(batch, rows, strict=True):
                out[i] = completion
            if on_batch is not None:
                on_batch(len(batch), sum(c.num_tokens for c in rows))
        return [c for c in out if c is not None]

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        max_new: int,
        stop: bool = True,
        batch: tuple[int, int] = (1, 1),
    ) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids_BT = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):  # left padding: every row ends at the same column
            ids_BT[b, width - len(prompt) :] = torch.tensor(prompt)
            mask_BT[b, width - len(prompt) :] = 1
        sampling = self.sampling
        # top_k None: transformers' default of 50 is not applied (0 is every token here too)
        kwargs = (
            {"do_sample": False, "top_k": None}
            if sampling.greedy
            else {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k or None,
            }
        )
        if sampling.repetition_penalty != 1:  # greedy too: it moves the argmax
            # on the device once: the processor runs at every decode step
            pads_B = torch.tensor([width - len(p) for p in prompts], device=self.device)
            penalty = PaddedRepetitionPenalty(sampling.repetition_penalty, pads_B)
            kwargs["logits_processor"] = LogitsProcessorList([penalty])
        cache = cache_kwargs(self.model, width + max_new) if self.preallocated else {}
        ticker = [StepTicker(self.on_step, batch, width, max_new)] if self.on_step else []
        seq_BX = self.model.generate(
            input_ids=ids_BT.to(self.device),
            attention_mask=mask_BT.to(self.device),
            max_new_tokens=max_new,
            min_new_tokens=0,
            eos_token_id=self.stop_ids if stop else None,  # None: the model's is not used
            pad_token_id=self.pad_id,
            use_cache=True,
            **self.cache_kwargs,
            stopping_criteria=StoppingCriteriaList(ticker),  # empty: transformers' default
            **cache,
            **kwargs,
        )
        new_BN = seq_BX[:, width:].tolist()
        stops = set(self.stop_ids) if stop else set()
        completions = []
        for row in new_BN:
            end = next((j for j, t in enumerate(row) if t in stops), None)
            reply = row if end is None else row[:end]
            # every special token the target wrote stays (the stop id is cut off above):
            # extract's tokenizer reads its text back as that id
            text = self.tokenizer.decode(reply, skip_special_tokens=False)
            stop_id = None if end is None else row[end]
            completions.append(Completion(text, len(reply), end is not None, reply, stop_id))
        return completions
