"""Source rows in, target-written rows out: what `dflash generate` asks the target, per row shape.

- Chat rows (`messages` or ShareGPT `conversations`): every assistant turn is rewritten by the
  target from the conversation so far, rendered by its own chat template with the generation
  prompt, turn by turn: the reply to turn 2 is written after the target's own reply to turn 1.
  System and user turns are kept verbatim. The output row is `messages` [{role, content}], and
  `wrote_end_of_turn`, one boolean per assistant turn: false where the target did not end its
  reply with the template's end of turn (cut at sampling.max_new_tokens, or ended by another stop
  token such as its `<|endoftext|>`), so extract trains on the reply but not on the end of turn
  the template writes after it (the target would have gone on, or wrote another token there).
- Completion rows (`prompt`, `completion`): the target writes a new completion of the prompt.
- Text rows: continuation windows. For every `stride` tokens of a document, the `prompt_tokens`
  tokens there are a prompt and the target writes `new_tokens` after them; the output row's
  `text` is both (loss on every token: measured better), or with `text.loss_on_prompt=false`
  `prompt` and `completion` (extract puts the loss on the completion only). A document
  shorter than one prompt is one window with all its tokens. A window that would start inside
  a character (its bytes split over tokens) starts at the next character instead.

All prompts of one round (chat: the r-th assistant turn of every conversation in the chunk;
text: every window) go to the backend together, so it can batch them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from transformers import GenerationConfig, PreTrainedTokenizerBase

from common.generated import eos_ids
from common.logging import get_logger
from stage1_extract.chat import SENTINEL, WROTE_END_OF_TURN, InvalidRow, normalize_conversation
from stage1_extract.config import TargetConfig
from stage1_extract.data import special_affixes, without_suffix
from stage1_generate.config import GenerateConfig
from stage1_generate.local_backend import Completion

# a character's bytes, so the most tokens one can be split over
UTF8_MAX_BYTES = 4
REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a cut character


class Backend(Protocol):
    # the positions a row may use (the target's max_position_embeddings, a server's
    # max_model_len), when the backend knows them, and which of those it is
    max_positions: int | None
    max_positions_source: str

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        on_batch: Callable[[int, int], None] | None = None,
        stop: bool = True,
    ) -> list[Completion]: ...


@dataclass
class ChunkResult:
    """The output rows of one chunk of source rows and what happened to them."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # reason -> source rows
    prompts: int = 0
    new_tokens: int = 0
    truncated: int = 0  # replies cut at the token limit instead of ending by themselves
    empty: int = 0  # replies with no text (the target ended at once); text and completion
    # rows with an empty reply are not written (no loss tokens), chat turns stay (no loss)
    # chat replies ended by a stop id other than the template's end of turn (its
    # `<|endoftext|>`): with `truncated`, the replies a row records as not `wrote_end_of_turn`
    other_stops: int = 0

    def count(self, completions: list[Completion]) -> None:
        self.prompts += len(completions)
        self.new_tokens += sum(c.num_tokens for c in completions)
        self.truncated += sum(not c.finished for c in completions)
        self.empty += sum(not c.text.strip() for c in completions)

    def stats(self) -> dict[str, Any]:
        return {
            "rows_out": len(self.rows),
            "skipped": dict(self.skipped),
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "truncated": self.truncated,
            "empty_replies": self.empty,
            "other_stops": self.other_stops,
        }


def end_of_turn_text(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any]) -> str:
    """What the chat template writes right after an assistant's content (e.g. `<|im_end|>`)."""
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SENTINEL}],
        tokenize=False,
        **template_kwargs,
    )
    return probe[probe.index(SENTINEL) + len(SENTINEL) :].strip() if SENTINEL in probe else ""


def end_of_turn_id(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any]
) -> int | None:
    """The first token of the chat template's end-of-turn text when it is a special token (the
    stop id a target writes to end its turn, e.g. `<|im_end|>`); None when there is none."""
    if not tokenizer.chat_template:
        return None
    end = end_of_turn_text(tokenizer, template_kwargs)
    end_ids = tokenizer(end, add_special_tokens=False)["input_ids"] if end else []
    specials = tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder)
    return end_ids[0] if end_ids and end_ids[0] in specials else None


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_eos: Any, template_kwargs: dict[str, Any]
) -> list[int]:
    """Ids that end a reply: the tokenizer's and the generation config's end of sequence, and
    the first token of the chat template's end-of-turn text when it is a special token."""
    ids = eos_ids(tokenizer.eos_token_id, generation_eos)
    if (end := end_of_turn_id(tokenizer, template_kwargs)) is not None:
        ids.append(end)
    if not ids:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path}: no end-of-sequence token and no chat template "
            "end-of-turn token: generation could not stop; set eos_token in its "
            "tokenizer_config.json"
        )
    return sorted(set(ids))


def generation_eos(target: TargetConfig) -> Any:
    """The end-of-sequence id(s) of the target's generation config, read from its files as
    transformers reads them when it loads the model (`model.generation_config.eos_token_id`:
    generation_config.json, else its config's), without loading the weights. Qwen3's lists
    its `<|endoftext|>` besides the tokenizer's `<|im_end|>`."""
    from stage1_extract.target import load_target_config

    try:
        found = GenerationConfig.from_pretrained(target.model, revision=target.revision)
    except OSError:  # no generation_config.json, or (a hub id) none that could be read
        found = GenerationConfig.from_model_config(load_target_config(target))
        if not Path(target.model).expanduser().is_dir() and not _known_absent(target):
            eos = "none" if found.eos_token_id is None else found.eos_token_id
            get_logger().warning(
                f"target {target.model}: its generation_config.json is not in the local hub "
                "cache and could not be fetched (HF_HUB_OFFLINE, or the hub unreachable): "
                f"assuming it has none, so replies stop at config.json's end of sequence "
                f"({eos}) besides the tokenizer's and the chat template's end; "
                "one its generation config lists besides (Qwen3's <|endoftext|>) would not stop "
                f"them nor be recorded in stop_ids: fetch it first (`hf download {target.model} "
                "generation_config.json`)"
            )
    return found.eos_token_id


def _known_absent(target: TargetConfig) -> bool:
    """Whether the hub cache records that the hub id `target.model` has no
    generation_config.json (a lookup found none), rather than not knowing."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    found = try_to_load_from_cache(target.model, "generation_config.json", revision=target.revision)
    return found is _CACHED_NO_EXIST


def _replies(
    backend: Backend,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    max_new_tokens: int,
    on_batch: Callable[[int, int], None] | None = None,
    stop: bool = True,
) -> list[Completion]:
    """The backend's replies to `prompts`, each cut at the token limit kept to whole
    characters (`whole_characters`)."""
    completions = backend.generate(prompts, max_new_tokens, on_batch, stop=stop)
    return [whole_characters(tokenizer, c) for c in completions]


def whole_characters(tokenizer: PreTrainedTokenizerBase, completion: Completion) -> Completion:
    """A reply cut at the token limit inside a character (byte-level BPE splits a character's
    bytes over tokens) without that character's first bytes: its text would end in a U+FFFD,
    which extract's tokenizer reads as tokens the target never wrote (and the drafter would
    learn to predict them); so the reply is a prefix of the target's. The tokens dropped are the
    fewest whose text holds the final U+FFFD (at most UTF8_MAX_BYTES - 1: a character's first
    bytes); a U+FFFD the target wrote there goes too, which keeps the reply a prefix. A server
    that gives the text alone (SGLang) ends it in the U+FFFD of the cut bytes: that one goes;
    vLLM's text leaves the cut bytes out already, its ids not. `num_tokens` stays what the
    target wrote (so with every backend). A reply that ended at a stop id is kept whole."""
    if completion.finished:
        return completion
    if completion.token_ids is None:
        if not completion.text.endswith(REPLACEMENT):
            return completion
        return replace(completion, text=completion.text[: -len(REPLACEMENT)])
    ids = completion.token_ids
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    if not whole.endswith(REPLACEMENT):
        return completion
    for kept in range(len(ids) - 1, max(len(ids) - UTF8_MAX_BYTES, -1), -1):
        head = tokenizer.decode(ids[:kept], skip_special_tokens=False)
        if whole[: -len(REPLACEMENT)].startswith(head):
            break
    else:
        return completion  # no token boundary before that U+FFFD: a tokenizer of other bytes
    # the local backend's text is its ids decoded; a server's is its own (vLLM's ends before
    # the cut bytes already): less the dropped tokens' text where it ends with it
    text, dropped = completion.text, tokenizer.decode(ids[kept:], skip_special_tokens=False)
    if text == whole:
        text = head
    elif text.endswith(dropped):
        text = text[: -len(dropped)]
    return replace(completion, text=text, token_ids=ids[:kept])


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as err:  # the template's raise_exception, or a Jinja error
        raise InvalidRow("template_error", f"the chat template failed: {err}") from err
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_fits(backend: Backend, prompt: list[int], max_new: int) -> None:
    """A prompt past the target's positions generates garbage without any error (rotary
    models run on, out of what they were trained for): such a row is invalid."""
    limit = backend.max_positions
    if limit is not None and len(prompt) + max_new > limit:
        raise InvalidRow(
            "too_long",
            f"the prompt has {len(prompt)} tokens, which with {max_new} new tokens exceeds "
            f"{backend.max_positions_source} ({limit}); shorten it, or lower "
            "sampling.max_new_tokens",
        )


def check_settings(
    cfg: GenerateConfig, fmt: str, limit: int | None, source: str, prefix_tokens: int
) -> None:
    """Refuse settings that no row could fit in `limit` positions (named by `source`): text
    windows of `prefix_tokens` (what the tokenizer puts first) + text.prompt_tokens +
    text.new_tokens, or a chat or completion reply of sampling.max_new_tokens after a prompt of
    one token at least. A row that does not fit is an invalid row (`_check_fits`)."""
    if limit is None:
        return
    if fmt == "text":
        text = cfg.text
        if prefix_tokens + text.prompt_tokens + text.new_tokens > limit:
            first = ""
            if prefix_tokens:
                plural = "s" if prefix_tokens > 1 else ""
                first = f" + {prefix_tokens} token{plural} the tokenizer puts first"
            raise ValueError(
                f"text.prompt_tokens {text.prompt_tokens} + text.new_tokens {text.new_tokens}"
                f"{first} exceed {source} ({limit}); lower them"
            )
    elif cfg.sampling.max_new_tokens >= limit:
        raise ValueError(
            f"sampling.max_new_tokens {cfg.sampling.max_new_tokens} leaves no room for a "
            f"prompt within {source} ({limit}): every row would be too long; lower "
            "sampling.max_new_tokens"
        )


def _invalid(cfg: GenerateConfig, index: int, err: InvalidRow, result: ChunkResult) -> None:
    if cfg.data.on_invalid != "skip":
        refusal = err.refusal(cfg.data.path, index)
        raise ValueError(f"{refusal} (finished chunks are kept)")
    result.skipped[err.reason] += 1


def generate_chat(
    raw_rows: list[Any],
    indices: list[int],
    fmt: str,
    cfg: GenerateConfig,
    tokenizer: PreTrainedTokenizerBase,
    backend: Backend,
    on_batch: Callable[[int, int], None] | None = None,
) -> ChunkResult:
    """Rewrite every assistant turn of the chunk's conversations, round by round."""
    check_settings(cfg, fmt, backend.max_positions, backend.max_positions_source, 0)
    result = ChunkResult()
    kwargs = cfg.data.chat_template_kwargs
    end_of_turn = end_of_turn_id(tokenizer, kwargs)
    convs: dict[int, list[dict[str, Any]]] = {}
    turns: dict[int, list[int]] = {}
    for k, raw in enumerate(raw_rows):
        try:
            # an empty assistant turn is a place for the target's reply (a prompt-only set)
            messages = normalize_conversation(raw, fmt, empty_replies_ok=True)
            positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if positions[0] == 0:  # the template has nothing to render a prompt from
                raise InvalidRow(
                    "assistant_first",
                    "message 0 is an assistant turn with nothing before it, so the target has "
                    "no prompt to write it from; remove that message or put a user or system "
                    "message before it",
                )
        except InvalidRow as err:
            _invalid(cfg, indices[k], err, result)
            continue
        convs[k], turns[k] = messages, positions
    truncated: Counter = Counter()
    ends: dict[int, list[bool]] = {k: [] for k in convs}
    for r in range(max((len(t) for t in turns.values()), default=0)):
        active, prompts = [], []
        for k in list(convs):
            if len(turns[k]) <= r:
                continue
            try:
                prompt = _render(tokenizer, convs[k][: turns[k][r]], kwargs)
                _check_fits(backend, prompt, cfg.sampling.max_new_tokens)
                prompts.append(prompt)
            except InvalidRow as err:
                _invalid(cfg, indices[k], err, result)
                del convs[k]
                continue
            active.append(k)
        completions = _replies(backend, tokenizer, prompts, cfg.sampling.max_new_tokens, on_batch)
        result.count(completions)
        for k, completion in zip(active, completions, strict=True):
            # only role and content: a rewritten turn's old tool calls or reasoning no
            # longer belong to it
            convs[k][turns[k][r]] = {"role": "assistant", "content": completion.text}
            truncated[k] += not completion.finished
            ends[k].append(wrote_end_of_turn(completion, end_of_turn))
            result.other_stops += completion.finished and not ends[k][-1]
    for k, messages in convs.items():
        result.rows.append(
            {
                "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "source_index": indices[k],
                "generated_turns": len(turns[k]),
                "truncated_turns": truncated[k],
                WROTE_END_OF_TURN: ends[k],
            }
        )
    return result


def wrote_end_of_turn(completion: Completion, end_of_turn: int | None) -> bool:
    """Whether the target ended a chat reply with the template's end of turn (`end_of_turn_id`),
    the token the template writes after the reply: not when the reply was cut at the token
    limit, nor when another stop id ended it (the target's `<|endoftext|>` where the template
    closes with `<|im_end|>`). A stop that a server did not name counts as the end of turn, the
    usual end of a chat reply."""
    return completion.finished and completion.stop_id in (None, end_of_turn)


def text_windows(ids: list[int], prompt_tokens: int, stride: int) -> list[int]:
    """Start offsets of the prompt windows of one document's token ids."""
    if len(ids) <= prompt_tokens:
        return [0] if ids else []
    return list(range(0, len(ids) - prompt_tokens + 1, stride))


def whole_character_start(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], start: int, end: int
) -> int:
    """`start`, or the first later token (before `end`) that begins a character: byte-level BPE
    splits a character's bytes over tokens, and a window starting after its first one would
    decode with a U+FFFD for the bytes before. The window's text then starts cleanly and the
    target is asked for exactly that text (as `_split_row` ends a prompt before a character
    cut at the seam). A start is moved only when its first tokens decode to a U+FFFD that the
    tokens before them make into a character: a U+FFFD of the document itself stays."""
    while start < end:
        head = tokenizer.decode(ids[start : start + UTF8_MAX_BYTES])
        if not head.startswith(REPLACEMENT):
            return start
        around = tokenizer.decode(ids[max(0, start - UTF8_MAX_BYTES) : start + UTF8_MAX_BYTES])
        if around.endswith(head):
            return start
        start += 1
    return start


def generate_text(
    raw_rows: list[Any],
    indices: list[int],
    cfg: GenerateConfig,
    tokenizer: PreTrainedTokenizerBase,
    backend: Backend,
    on_batch: Callable[[int, int], None] | None = None,
) -> ChunkResult:
    """Continue every window of the chunk's text documents."""
    # extract tokenizes the written row with the tokenizer's defaults (e.g. Llama's BOS first):
    # the target writes after that same prefix, so it sees what the drafter's context will be
    prefix = special_prefix(tokenizer)
    check_settings(cfg, "text", backend.max_positions, backend.max_positions_source, len(prefix))
    result = ChunkResult()
    windows: list[tuple[int, int, list[int]]] = []  # (source index, start, prompt ids)
    valid = [(k, t) for k, t in enumerate(raw_rows) if isinstance(t, str) and t.strip()]
    for k, text in enumerate(raw_rows):
        if not (isinstance(text, str) and text.strip()):
            err = InvalidRow("empty_text", f"{cfg.data.text_field!r} is empty or not a string")
            _invalid(cfg, indices[k], err, result)
    # (a chunk of empty rows only: the tokenizer refuses an empty batch)
    texts = [t for _, t in valid]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for (k, _), ids in zip(valid, encoded, strict=True):
        for planned in text_windows(ids, cfg.text.prompt_tokens, cfg.text.stride):
            end = planned + cfg.text.prompt_tokens
            start = whole_character_start(tokenizer, ids, planned, end)
            if start < end:
                windows.append((indices[k], start, prefix + ids[start:end]))
    stop = cfg.text.stop_at_eos
    prompts = [w[2] for w in windows]
    completions = _replies(backend, tokenizer, prompts, cfg.text.new_tokens, on_batch, stop)
    result.count(completions)
    for (index, start, prompt), completion in zip(windows, completions, strict=True):
        if not completion.text.strip():
            continue  # the target ended the document at once: nothing of its own to learn
        # the prefix (e.g. Llama's BOS) stays out of the row: extract adds it again
        row = _split_row(tokenizer, prompt[len(prefix) :], completion, cfg.text.loss_on_prompt)
        row.update(source_index=index, window_start=start, new_tokens=completion.num_tokens)
        result.rows.append(row)
    return result


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids the tokenizer puts before a text by default (a BOS for Llama; none for Qwen)."""
    return special_affixes(tokenizer)[0]


def _split_row(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[int],
    completion: Completion,
    as_text: bool,
) -> dict[str, Any]:
    """{text} or {prompt, completion} of one window. The whole window is decoded at once when
    the reply's ids are known, so no character is cut at the seam. Prompt and reply keep their
    special tokens as text (a document's own `<|endoftext|>` or chat markers, one the target
    wrote), and a reply that the target ended ends with its stop token's text (the backends
    cut the stop id off; `_stop_text`): extract's tokenizer reads them back as the ids the
    target saw and wrote, the stop included, so the drafter learns where the target stops."""
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=False)
    if completion.token_ids is None:
        reply_text = completion.text
    else:
        text = tokenizer.decode(prompt + completion.token_ids, skip_special_tokens=False)
        # the seam split a character (its bytes over several tokens): the prompt ends before
        # that character's first token, so prompt + completion is the text itself
        cut = len(prompt)
        while cut > 0 and not text.startswith(prompt_text):
            cut -= 1
            prompt_text = tokenizer.decode(prompt[:cut], skip_special_tokens=False)
        reply_text = text[len(prompt_text) :]
    reply_text += _stop_text(tokenizer, completion.stop_id)
    if as_text:
        return {"text": prompt_text + reply_text}
    return {"prompt": prompt_text, "completion": reply_text}


def _stop_text(tokenizer: PreTrainedTokenizerBase, stop_id: int | None) -> str:
    """The text of the stop id that ended a reply (e.g. `<|endoftext|>`), written after the
    reply of a text or completion row: no chat template writes an end there, and without it
    extract stored no stop, so the drafter never learned to predict one where the target
    writes it. Empty when the reply was cut at the token limit, or when the tokenizer would
    not read the text back as that id (a stop id that is no special token)."""
    if stop_id is None:
        return ""
    text = tokenizer.decode([stop_id], skip_special_tokens=False)
    return text if tokenizer(text, add_special_tokens=False)["input_ids"] == [stop_id] else ""


def generate_completion(
    raw_prompts: list[Any],
    indices: list[int],
    cfg: GenerateConfig,
    tokenizer: PreTrainedTokenizerBase,
    backend: Backend,
    on_batch: Callable[[int, int], None] | None = None,
) -> ChunkResult:
    """A new completion by the target for every `prompt` (completion rows; the old completion
    is dropped)."""
    check_settings(cfg, "completion", backend.max_positions, backend.max_positions_source, 0)
    prefix, suffix = special_affixes(tokenizer)
    result = ChunkResult()
    keep: list[int] = []
    prompts: list[list[int]] = []
    for k, prompt in enumerate(raw_prompts):
        try:
            if not (isinstance(prompt, str) and prompt):
                field_name = cfg.data.prompt_field
                raise InvalidRow("bad_prompt", f"{field_name!r} is empty or not a string")
            # the target continues the prompt as extract will store it: after the tokenizer's
            # prefix (a BOS), not after an EOS it appends, which would end the document there
            ids = without_suffix(list(tokenizer(prompt)["input_ids"]), suffix)
            _check_fits(backend, ids, cfg.sampling.max_new_tokens)
        except InvalidRow as err:
            _invalid(cfg, indices[k], err, result)
            continue
        keep.append(k)
        prompts.append(ids)
    completions = _replies(backend, tokenizer, prompts, cfg.sampling.max_new_tokens, on_batch)
    result.count(completions)
    for k, prompt, completion in zip(keep, prompts, completions, strict=True):
        if not completion.text.strip():
            continue  # counted in empty_replies; a row without loss tokens trains nothing
        # the tokenizer's prefix (a BOS) stays out, as for text rows: extract tokenizes the
        # prompt with the same defaults and adds it again (written as text, it would be there
        # twice)
        body = prompt[len(prefix) :] if prompt[: len(prefix)] == prefix else prompt
        row = _split_row(tokenizer, body, completion, as_text=False)
        row.update(source_index=indices[k], new_tokens=completion.num_tokens)
        result.rows.append(row)
    return result
