"""Read the input dataset and turn every row into one document: token ids plus a loss mask.

Accepted inputs: a local .json/.jsonl/.jsonl.gz/.parquet file or a folder of them, a
`datasets.save_to_disk` folder, or a hub dataset name (needs network). Accepted rows: `messages`
[{role, content}], ShareGPT `conversations` [{from, value}] (both rendered by the tokenizer's
own chat template, loss on assistant turns; see `stage1_extract/chat.py`; a `wrote_end_of_turn`
column, as `dflash generate` writes, says which turns' end of turn to leave without loss), plain
`text` (loss on every token) or `prompt` + `completion` (loss on the completion). A text or prompt gets what the
tokenizer puts before a text by default (Llama's BOS: the target was trained to see it), never
what it appends (an EOS, for a tokenizer set to add one): that says the document ended there,
which a text row does not say and a prompt contradicts; an end the data holds is written in it
(`<|endoftext|>` as text, read back as its id). Tokenization is a batched `datasets` map of a
module-level function, so its result is cached by fingerprint and a rerun of the same data and
tokenizer is free.

    from stage1_extract.data import prepare_documents
    prepared = prepare_documents(cfg.data, tokenizer)   # .dataset: input_ids, loss_mask, source_index
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from stage1_extract.chat import (
    WROTE_END_OF_TURN,
    InvalidRow,
    is_empty_turn,
    normalize_conversation,
    tokenize_conversations,
)
from stage1_extract.config import DataConfig
from stage1_extract.data_files import LOCAL_BUILDERS, load_local, looks_local

# the key of `PreparedData.skipped` counting assistant turns kept without loss tokens
EMPTY_TURNS = "empty_assistant_turn"
# the skip reason of a row whose loss tokens all lie past what packing.overlong=truncate keeps
NO_LOSS_KEPT = "no_loss_tokens_after_truncation"
DEFAULT_FIELDS = {"messages": "messages", "sharegpt": "conversations"}
FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("uint8")),
        "source_index": datasets.Value("int64"),
        "skip_reason": datasets.Value("string"),  # "" for a valid row
        "empty_turns": datasets.Value("int32"),  # kept assistant turns without loss (chat.py)
    }
)


@dataclass
class PreparedData:
    dataset: datasets.Dataset  # columns: input_ids, loss_mask (0/1), source_index (raw row)
    format: str  # "messages" | "sharegpt" | "text": the one detected or asked for
    num_rows: int  # rows read from the raw dataset (after max_samples)
    # reason -> rows skipped (on_invalid="skip"), and EMPTY_TURNS -> turns kept without loss
    skipped: dict[str, int] = field(default_factory=dict)
    # ids the tokenizer appends to a text by default that text and completion rows leave out
    # (an EOS; empty for most tokenizers and for chat rows)
    suffix_left_out: list[int] = field(default_factory=list)


def load_raw_dataset(cfg: DataConfig) -> datasets.Dataset:
    """The raw rows of `cfg.path` (local file/folder or hub dataset), cut to `max_samples`."""
    path = Path(cfg.path).expanduser()
    if path.exists():
        ds = load_local(path, cfg.split)
    elif looks_local(cfg.path):
        raise ValueError(
            f"data file {cfg.path} does not exist; pass an existing "
            f"{'/'.join(LOCAL_BUILDERS)} file or folder of them with --data"
        )
    else:
        try:
            ds = datasets.load_dataset(cfg.path, cfg.name, split=cfg.split)
        except Exception as err:  # offline, unknown name, wrong split: all end here
            raise ValueError(
                f"data {cfg.path!r} is neither a local file/folder nor a reachable hub dataset "
                f"(name={cfg.name!r}, split={cfg.split!r}): {type(err).__name__}: {err}; pass "
                f"a local {'/'.join(LOCAL_BUILDERS)} file or folder of them with --data, or "
                "check the hub name, data.name and data.split, the network and HF_DATASETS_OFFLINE"
            ) from err
    if cfg.max_samples is not None and cfg.max_samples < len(ds):
        ds = ds.select(range(cfg.max_samples))
    return ds


def _message_fields(feature: Any) -> dict[str, Any]:
    """The message struct's fields of a list-of-structs column (from the schema, no row read)."""
    inner = getattr(feature, "feature", None)
    return inner if isinstance(inner, dict) else {}


def _message_keys(feature: Any) -> set[str]:
    """Field names of the messages of a list-of-structs column."""
    return set(_message_fields(feature))


def _string_contents(feature: Any, fmt: str) -> bool:
    """Whether the schema says every message's content is a string (no list of parts)."""
    value = _message_fields(feature).get("value" if fmt == "sharegpt" else "content")
    return getattr(value, "dtype", None) in ("string", "large_string")


def detect_format(cfg: DataConfig, features: datasets.Features) -> tuple[str, str]:
    """(format, column) of the rows: `cfg.format` checked against the columns, or, for "auto",
    picked by column name and by the message fields ({role, content} or {from, value})."""
    columns = list(features)
    wanted, found = cfg.format, None
    if wanted == "auto":
        chat_columns = [cfg.messages_field] if cfg.messages_field else ["messages", "conversations"]
        found = next((c for c in chat_columns if c in columns), None)
        if found is not None:
            # datasets name columns loosely ("conversations" of {role, content} is common)
            keys = _message_keys(features[found])
            if keys:
                wanted = "sharegpt" if "from" in keys and "role" not in keys else "messages"
            else:
                wanted = "sharegpt" if found == "conversations" else "messages"
        elif cfg.messages_field is None and cfg.text_field in columns:
            wanted = "text"
        elif {cfg.prompt_field, cfg.completion_field} <= set(columns):
            wanted = "completion"
    if wanted == "text":
        column = cfg.text_field
    elif wanted == "completion":
        column = cfg.prompt_field if cfg.completion_field in columns else ""
    elif wanted in DEFAULT_FIELDS:
        column = found or cfg.messages_field or DEFAULT_FIELDS[wanted]
    else:
        column = ""
    if column not in columns:
        raise ValueError(
            f"data {cfg.path}: columns {columns} match no accepted row shape (format "
            f"{cfg.format!r}); accepted: 'messages' [{{role, content}}], ShareGPT "
            f"'conversations' [{{from, value}}], plain text in {cfg.text_field!r}, or "
            f"{cfg.prompt_field!r} + {cfg.completion_field!r} strings. Fix with --set "
            "data.format=messages|sharegpt|text|completion and --set data.messages_field=COLUMN, "
            "data.text_field=COLUMN or data.prompt_field/completion_field=COLUMN"
        )
    return wanted, column


def _tokenize_batch(
    batch: dict[str, list[Any]],
    indices: list[int],
    *,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str,
    column: str,
    skip_invalid: bool,
    where: str,
    completion_column: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    suffix: list[int] | None = None,
    content_parts: str | None = None,
    tool_calls: str | None = None,
    turn_ends: str | None = None,
) -> dict[str, list[Any]] | pa.Table:
    """One `datasets.map` batch; module-level with plain arguments so its fingerprint is stable.
    `suffix`: the tokenizer's default suffix, left out of text rows and prompts.
    `turn_ends`: the column saying which assistant turns the target ended (`_unended`); its
    name also keys the map's cache, whose masks of versions before trained every end of turn.
    `tool_calls`: not read; keys the map's cache of messages that carry tool calls, whose
    turns versions before trained nothing (a cache of those masks would stay).
    `content_parts`: not read; keys the map's cache of rows whose contents may be lists of
    parts, which versions before `text_of_parts` refused (a cache of their skips would stay)."""
    rows = batch[column]
    suffix = suffix or []
    if fmt == "text":
        return _text_batch(rows, indices, tokenizer, column, skip_invalid, where, suffix)
    results: list[Any] = [None] * len(rows)
    chats: dict[int, list[dict[str, Any]]] = {}
    if fmt == "completion":
        assert completion_column is not None
        for k, (prompt, completion) in enumerate(zip(rows, batch[completion_column], strict=True)):
            results[k] = _prompt_completion(
                tokenizer, prompt, completion, column, completion_column, suffix
            )
    else:
        unended: dict[int, frozenset[int]] = {}
        for k, raw in enumerate(rows):
            try:
                chats[k] = normalize_conversation(raw, fmt)
                ends = batch[turn_ends][k] if turn_ends else None
                unended[k] = _unended(chats[k], ends, turn_ends or "")
            except InvalidRow as err:
                chats.pop(k, None)
                results[k] = err
        for k, out in zip(
            chats,
            tokenize_conversations(
                tokenizer, list(chats.values()), template_kwargs, [unended[k] for k in chats]
            ),
            strict=True,
        ):
            results[k] = out

    out: dict[str, list[Any]] = {
        "input_ids": [],
        "loss_mask": [],
        "source_index": [],
        "skip_reason": [],
        "empty_turns": [],
    }
    for k, result in enumerate(results):
        if not isinstance(result, InvalidRow) and not any(result[1]):
            result = _no_loss_tokens()
        if isinstance(result, InvalidRow):
            result_ids, result_mask = [], []
            reason = _skip_reason(result, skip_invalid, where, indices[k])
        else:
            (result_ids, result_mask), reason = result, ""
        out["input_ids"].append(result_ids)
        out["loss_mask"].append(result_mask)
        out["source_index"].append(indices[k])
        out["skip_reason"].append(reason)
        messages = [] if reason else chats.get(k, [])
        out["empty_turns"].append(sum(is_empty_turn(m) for m in messages))
    return out


def _unended(messages: list[dict[str, Any]], ends: Any, column: str) -> frozenset[int]:
    """The assistant messages whose end of turn the target did not write, from `ends` (the
    row's `column`: one boolean per assistant message, in order; None when the row has none:
    every turn ended)."""
    if ends is None:
        return frozenset()
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not (
        isinstance(ends, list)
        and len(ends) == len(assistants)
        and all(isinstance(e, bool) for e in ends)
    ):
        raise InvalidRow(
            "bad_turn_ends",
            f"{column!r} must hold one true/false per assistant message ({len(assistants)}), "
            f"got {ends!r:.80}",
        )
    return frozenset(i for i, ended in zip(assistants, ends, strict=True) if not ended)


def _no_loss_tokens() -> InvalidRow:
    return InvalidRow("no_loss_tokens", "the row has no loss tokens after tokenization")


def _skip_reason(err: InvalidRow, skip_invalid: bool, where: str, index: int) -> str:
    """The skip reason stored for the row `err` rejects; with data.on_invalid=error, the
    refusal naming the row instead."""
    if not skip_invalid:
        raise err.refusal(where, index)
    return err.reason


def _text_batch(
    rows: list[Any],
    indices: list[int],
    tokenizer: PreTrainedTokenizerBase,
    column: str,
    skip_invalid: bool,
    where: str,
    suffix: list[int],
) -> pa.Table:
    """`_tokenize_batch` of text rows (the tokenizer's default ids but `suffix`, loss on every
    token), as an Arrow table: a generate folder holds tens of millions of tokens, and
    per-token Python lists (ids copied, masks of ones, both converted again by `datasets`) cost
    10% of the map's time on pystd-28m."""
    usable = [isinstance(text, str) and bool(text.strip()) for text in rows]
    keep = [k for k, ok in enumerate(usable) if ok]
    ids: list[list[int]] = [[] for _ in rows]
    for k, row_ids in zip(keep, _text_ids(tokenizer, [rows[k] for k in keep]), strict=True):
        ids[k] = without_suffix(row_ids, suffix)
    reasons = []
    for k, ok in enumerate(usable):
        if ok and ids[k]:
            reasons.append("")
            continue
        err = (
            _no_loss_tokens()
            if ok
            else InvalidRow("empty_text", f"{column!r} is empty or not a string")
        )
        reasons.append(_skip_reason(err, skip_invalid, where, indices[k]))
    input_ids = pa.array(ids, type=pa.list_(pa.int32()))
    ones = pa.array(np.ones(len(input_ids.values), dtype=np.uint8))
    columns = {
        "input_ids": input_ids,
        "loss_mask": pa.ListArray.from_arrays(input_ids.offsets, ones),
        "source_index": pa.array(indices, type=pa.int64()),
        "skip_reason": pa.array(reasons, type=pa.string()),
        "empty_turns": pa.array(np.zeros(len(rows), dtype=np.int32)),
    }
    return pa.Table.from_pydict(columns, schema=FEATURES.arrow_schema)


# methods whose override in a tokenizer class may change what a plain call returns
_CALL_PATH = (
    "__call__",
    "_call_one",
    "encode_plus",
    "batch_encode_plus",
    "_encode_plus",
    "_batch_encode_plus",
)


def _text_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]`. A plain call has the Rust tokenizer track every token's
    character offsets, which text rows never use: `encode_batch_fast` skips them and gives the
    same ids in 25% less CPU time (pystd-28m, the bulk of extract's start on generated data).
    Taken only where the call adds nothing to the Rust pipeline: a fast tokenizer class that
    overrides none of the call path, no input/target mode, no truncation or padding set."""
    cls = type(tokenizer)
    # getattr: transformers 5's base class and some backends (mistral-common) have neither
    backend = (
        getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "is_fast", False)
        else None
    )
    plain = (
        backend is not None
        # tokenizers >= 0.21 (older ones, and stand-ins, take the plain call)
        and hasattr(backend, "encode_batch_fast")
        and all(
            getattr(cls, m, None) is getattr(PreTrainedTokenizerFast, m, None) for m in _CALL_PATH
        )
        and not hasattr(tokenizer, "_switch_to_input_mode")
        and backend.truncation is None
        and backend.padding is None
        and getattr(backend, "encode_special_tokens", None)
        == getattr(tokenizer, "split_special_tokens", None)
    )
    if not plain:
        return tokenizer(texts)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts)]


def special_affixes(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text by default (a BOS before for Llama;
    an EOS after for a tokenizer set to add one, e.g. add_eos_token=true; none for Qwen)."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    default = tokenizer("x")["input_ids"]
    for i in range(len(default) - len(plain) + 1):
        if default[i : i + len(plain)] == plain:
            return list(default[:i]), list(default[i + len(plain) :])
    return [], []


def without_suffix(ids: list[int], suffix: list[int]) -> list[int]:
    """`ids` (a text tokenized with the tokenizer's defaults) without the `suffix` it appended."""
    return ids[: -len(suffix)] if suffix and ids[-len(suffix) :] == suffix else ids


def _prompt_completion(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Any,
    completion: Any,
    p_col: str,
    c_col: str,
    suffix: list[int],
) -> tuple[list[int], list[int]] | InvalidRow:
    """Prompt ids (the tokenizer's defaults but `suffix`, as for text) then completion ids;
    loss on the completion only: the drafter learns what the target wrote, in the context it
    wrote it in (`dflash generate` feeds the target the same prompt ids)."""
    if not isinstance(prompt, str):
        return InvalidRow("bad_prompt", f"{p_col!r} is not a string")
    if not (isinstance(completion, str) and completion.strip()):
        return InvalidRow("empty_completion", f"{c_col!r} is empty or not a string")
    # an empty prompt still gets the tokenizer's prefix (Llama's BOS), as the same text as a
    # text row would: the target runs on what it would see
    prompt_ids = without_suffix(list(tokenizer(prompt)["input_ids"]), suffix)
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return list(prompt_ids) + list(completion_ids), [0] * len(prompt_ids) + [1] * len(
        completion_ids
    )


def _no_loss_kept(docs: datasets.Dataset, keep: int) -> list[int]:
    """Rows of `docs` (the tokenizing map's output, every row) longer than `keep` tokens whose
    first `keep` hold no loss token: truncated to them, a row trains nothing (anchors are loss
    tokens, and a sequence's documents do not see each other)."""
    mask = docs.data.column("loss_mask")
    over = np.flatnonzero(pc.list_value_length(mask).to_numpy(zero_copy_only=False) > keep)
    if not len(over):
        return []
    head = pc.list_slice(mask.take(over).combine_chunks(), 0, keep)
    loss = pc.list_flatten(head).to_numpy(zero_copy_only=False)
    kept = np.bincount(pc.list_parent_indices(head).to_numpy(), weights=loss, minlength=len(over))
    return over[kept == 0].tolist()


def _no_loss_kept_row(mask: list[int], keep: int, count: int) -> InvalidRow:
    """The error of a row `_no_loss_kept` finds (`mask`: its loss mask), `count` such rows in
    all: what truncation leaves of it, and the settings that would keep its loss."""
    first = mask.index(1)
    return InvalidRow(
        NO_LOSS_KEPT,
        f"its {len(mask)} tokens have loss from token {first} on, and packing.overlong=truncate "
        f"keeps its first {keep} (packing.seq_len), none of them a loss token ({count} such "
        f"row(s) in all); --set packing.seq_len={first + 1} or more (within the target's "
        "positions), or --set packing.overlong=split to keep the rest as pieces of their own",
    )


def prepare_documents(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, truncate_to: int | None = None
) -> PreparedData:
    """Load `cfg.path` and tokenize every row (dataset order) into input_ids / loss_mask.
    `truncate_to`: the tokens packing keeps of a row (packing.seq_len under
    packing.overlong=truncate); a row with no loss token among them is invalid (NO_LOSS_KEPT),
    as one with none at all is."""
    raw = load_raw_dataset(cfg)
    fmt, column = detect_format(cfg, raw.features)
    name = tokenizer.name_or_path or type(tokenizer).__name__
    chat = fmt in DEFAULT_FIELDS
    # (chat rows: the template writes every special token itself, nothing is appended)
    suffix = [] if chat else special_affixes(tokenizer)[1]
    if chat and not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {name} has no chat_template, but data {cfg.path} holds conversations "
            f"({column!r}); use a tokenizer that has one (--set target.tokenizer=...), add a "
            "chat_template to its tokenizer_config.json, or give plain text (--set data.format=text)"
        )
    if chat and not tokenizer.is_fast:
        raise ValueError(
            f"tokenizer {name} is a slow (Python) tokenizer; the loss mask needs the character "
            "offsets of a fast tokenizer: save it with a tokenizer.json or pass one that has it"
        )
    docs = raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=256,
        with_indices=True,
        fn_kwargs={
            "tokenizer": tokenizer,
            "fmt": fmt,
            "column": column,
            "skip_invalid": cfg.on_invalid == "skip",
            "where": cfg.path,
            **({"completion_column": cfg.completion_field} if fmt == "completion" else {}),
            # only when given: the cache fingerprint of runs without them stays as it was
            **({"template_kwargs": cfg.chat_template_kwargs} if cfg.chat_template_kwargs else {}),
            # likewise: only a tokenizer that appends a suffix gets other rows than before
            # (the map's cache is keyed by these arguments, never by this module's code)
            **({"suffix": suffix} if suffix else {}),
            # likewise: only contents that may be lists of parts, which earlier versions refused
            **(
                {"content_parts": "joined"}
                if chat and not _string_contents(raw.features[column], fmt)
                else {}
            ),
            # likewise: messages with tool calls, whose turns earlier versions left without loss
            **(
                {"tool_calls": "trained"}
                if chat and "tool_calls" in _message_keys(raw.features[column])
                else {}
            ),
            # likewise: rows that say which turns the target did not end (cut at the token
            # limit), whose end of turn earlier versions trained
            **(
                {"turn_ends": WROTE_END_OF_TURN}
                if chat and WROTE_END_OF_TURN in raw.column_names
                else {}
            ),
        },
        remove_columns=raw.column_names,
        features=FEATURES,
        num_proc=cfg.num_proc if cfg.num_proc > 1 and len(raw) > 1 else None,
        desc="tokenizing",
    )
    # after the map, which is cached by its arguments: packing.seq_len leaves the cache as it is
    cut = _no_loss_kept(docs, truncate_to) if truncate_to is not None else []
    if cut and cfg.on_invalid == "error":
        row = docs[cut[0]]
        err = _no_loss_kept_row(row["loss_mask"], truncate_to, len(cut))
        raise err.refusal(cfg.path, row["source_index"])
    skipped: dict[str, int] = {}
    if cfg.on_invalid == "skip":
        reasons = docs["skip_reason"][:]
        for i in cut:
            reasons[i] = NO_LOSS_KEPT
        skipped = dict(Counter(r for r in reasons if r))
        if skipped:
            docs = docs.select([i for i, r in enumerate(reasons) if not r])
    # kept rows, counted with the skips: the turns that gave no loss tokens
    empty_turns = sum(docs["empty_turns"])
    if empty_turns:
        skipped[EMPTY_TURNS] = empty_turns
    docs = docs.remove_columns(["skip_reason", "empty_turns"])
    return PreparedData(
        dataset=docs, format=fmt, num_rows=len(raw), skipped=skipped, suffix_left_out=suffix
    )
