"""What `dflash generate` reads and records before it generates: the tokenizer, the source
rows (checked), and the manifest of provenance whose `content` decides whether a rerun resumes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, NamedTuple

import datasets
from transformers import PreTrainedTokenizerBase

from common.config import runs_tf32, to_dict
from common.generated import FORMAT, PROMPT_SUFFIX_LEFT_OUT, VERSION
from stage1_extract.data import detect_format, load_raw_dataset
from stage1_extract.fingerprints import weights_fingerprint
from stage1_extract.store_root import _canonical_path, content_key, is_local
from stage1_generate.config import GenerateConfig

# the content key that says a reply keeps the special tokens the target wrote in it
REPLY_SPECIALS = "reply_special_tokens"
# the content key that says a text or completion row's reply ends with the text of the stop
# token that ended it (versions before left it out: extract stored no stop for such rows)
REPLY_STOP = "reply_stop_token"
# the content key that says a chat row records which assistant turns the target ended with the
# template's end of turn (`wrote_end_of_turn`; versions before did not, and extract trained on
# the end of turn after a reply cut at the token limit)
TURN_ENDS = "chat_turn_ends"


def load_tokenizer(
    cfg: GenerateConfig, model_name: str = "target.model"
) -> PreTrainedTokenizerBase:
    """Extract's tokenizer loader; `model_name`: how the user gave the target (--model or
    target.model), named when it is no model."""
    from stage1_extract.job import load_tokenizer as load_extract_tokenizer

    return load_extract_tokenizer(_as_extract_config(cfg), model_name)


def _as_extract_config(cfg: GenerateConfig) -> Any:
    from stage1_extract.config import ExtractConfig

    return ExtractConfig(target=cfg.target.as_target_config(), data=cfg.data)


def check_inputs(
    cfg: GenerateConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[datasets.Dataset, str, str]:
    """The raw rows, their format and column; ValueError for what cannot be generated."""
    raw = load_raw_dataset(cfg.data)
    fmt, column = detect_format(cfg.data, raw.features)
    if fmt in ("messages", "sharegpt") and not tokenizer.chat_template:
        name = tokenizer.name_or_path or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name} has no chat_template, but data {cfg.data.path} holds "
            f"conversations ({column!r}): the target's replies are rendered by its own "
            "template; use a tokenizer that has one (--set target.tokenizer=...) or give "
            "plain text (--set data.format=text)"
        )
    if len(raw) == 0:
        raise ValueError(f"data {cfg.data.path} has no rows")
    return raw, fmt, column


def build_manifest(
    cfg: GenerateConfig,
    raw: datasets.Dataset,
    fmt: str,
    suffix: list[int],
    stop_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Provenance and the settings that decide the rows (hashed into `key`); `suffix`: the ids
    the tokenizer appends to a text by default (`special_affixes`); `stop_ids`: the ids that
    end the target's replies (`stop_token_ids` with its generation config's end of sequence),
    recorded for `chained_tau`, which counts a reply's stop token as `dflash evaluate` does."""
    config = to_dict(cfg)
    # a chunk finished under on_invalid=error holds the same rows it would under skip
    data = {k: v for k, v in config["data"].items() if k not in ("num_proc", "on_invalid")}
    data["path"] = _canonical_path(data["path"])
    backend = cfg.run.backend
    target = {
        "model": _canonical_path(cfg.target.model),
        "revision": cfg.target.revision,
        "tokenizer": cfg.target.tokenizer,
        "dtype": cfg.target.dtype if backend == "local" else None,
        "weights_sha256": weights_fingerprint(cfg.target.model),
    }
    # TF32 matmuls can turn near ties (other rows; a bf16 target's are the same either way);
    # named only when on, so the keys of datasets generated before the option existed stay
    if backend == "local" and runs_tf32(cfg.target.dtype, cfg.target.matmul_precision):
        target["matmul_precision"] = cfg.target.matmul_precision
    # stop_at_eos named only when off, so the keys of datasets generated before it existed stay
    text = {k: v for k, v in config["text"].items() if not (k == "stop_at_eos" and v)}
    content: dict[str, Any] = decisive_content(
        {
            "target": target,
            "backend": backend,
            "served_model": cfg.endpoint.model or cfg.target.model if backend == "openai" else None,
            "data": data,
            "data_fingerprint": raw._fingerprint,
            "format": fmt,
            "sampling": config["sampling"],
            "text": text if fmt == "text" else None,
            "rows_per_chunk": cfg.output.rows_per_chunk,
        }
    )
    if fmt != "text" or cfg.text.stop_at_eos:
        # the rows whose replies versions before it wrote without the special tokens the
        # target wrote inside them: its key refuses to resume such a folder (rows of either
        # kind would mix); past the end of text they were kept already
        content[REPLY_SPECIALS] = "kept"
    if fmt == "completion" or (fmt == "text" and cfg.text.stop_at_eos):
        # versions before it wrote these replies without the stop token that ended them (chat
        # rows get the template's end of turn; past the end of text nothing stops)
        content[REPLY_STOP] = "written"
    if fmt in ("messages", "sharegpt"):
        content[TURN_ENDS] = "recorded"
    if fmt == "completion" and suffix:
        # versions before it fed the target each prompt followed by that suffix (an EOS): its
        # key refuses to resume such a folder, and extract refuses a finished one
        content[PROMPT_SUFFIX_LEFT_OUT] = suffix
    return {
        "format": FORMAT,
        "version": VERSION,
        "key": content_key(content),
        "content": content,
        "target": content["target"],
        "source": {"path": cfg.data.path, "format": fmt, "num_rows": len(raw)},
        "backend": {"kind": backend, "endpoint": cfg.endpoint.url if backend == "openai" else None},
        "stop_ids": stop_ids,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "num_chunks": -(-len(raw) // cfg.output.rows_per_chunk),
        "complete": False,
    }


def decisive_sampling(sampling: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The sampling settings that decide the rows of format `fmt`: text windows write
    text.new_tokens (sampling.max_new_tokens is never read for them), and a greedy run
    (temperature 0) takes the target's argmax, which no seed, top-p or top-k changes. Left out
    of the content only there, so a rerun that changes them resumes; the content of a folder
    begun before (which named them) is read through this too, so it resumes with its same
    settings. top_k 0 (every token) and repetition_penalty 1 (none) are left out as well:
    folders begun before those keys existed sampled so, and name neither. (A repetition
    penalty changes greedy rows too: it stays in a greedy run's content.)"""
    unused = {"max_new_tokens"} if fmt == "text" else set()
    if sampling.get("temperature") == 0:
        unused |= {"seed", "top_p", "top_k"}
    if sampling.get("top_k") == 0:
        unused.add("top_k")
    if sampling.get("repetition_penalty") == 1:
        unused.add("repetition_penalty")
    return {k: v for k, v in sampling.items() if k not in unused}


def decisive_content(content: dict[str, Any]) -> dict[str, Any]:
    """`content` with only its decisive sampling settings (`decisive_sampling`), and without
    the target.revision of a local target folder or the data.name of a local data file or
    folder, which neither reads (null, as when unset): a rerun that changes them resumes, and
    so does a folder begun before with them set."""
    out = {**content, "sampling": decisive_sampling(content["sampling"], content["format"])}
    target, data = content["target"], content["data"]
    if target.get("revision") is not None and is_local(target["model"]):
        out["target"] = {**target, "revision": None}
    if data.get("name") is not None and is_local(data["path"]):
        out["data"] = {**data, "name": None}
    return out


class Inputs(NamedTuple):
    """What a process reads before generating: the tokenizer and the checked source rows."""

    tokenizer: PreTrainedTokenizerBase
    raw: datasets.Dataset
    fmt: str
    column: str


def read_inputs(cfg: GenerateConfig, model_name: str = "target.model") -> Inputs:
    tokenizer = load_tokenizer(cfg, model_name)
    return Inputs(tokenizer, *check_inputs(cfg, tokenizer))
