"""`dflash generate`: a special token the target writes inside a reply (not the stop token that
ends it) stays in the row as its text, so extract's tokens of the row are the target's own.

The target is scripted: tiny_qwen3 with its attention and MLP outputs zeroed, so each next
token depends on the last one alone, through one-hot embeddings and an LM head that maps each
token of a chain to the next: after a chat prompt's generation prompt or a document's last
token it writes SCRIPT (chat markers and an end of text inside it; none of them is the tiny
tokenizer's stop token `<|im_end|>`), then `<|im_end|>`. SCRIPT is the tokenizer's own reading
of its text, so any difference in extract's tokens is one the row made.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.generated import manifest_path, read_manifest
from stage1_extract.data import prepare_documents
from stage1_extract.store_root import content_key
from stage1_generate.inputs import REPLY_SPECIALS
from stage1_generate.run import run_generate
from tests.openai_server import OpenAIServer
from tests.test_generate import config, extract_config, read_rows, write_jsonl

SCRIPT = " Sure<|im_start|> thing<|endoftext|> is<|mask|> 42."
DOC = "the quick brown fox"  # shorter than text.prompt_tokens: one window of all of it
CHAT = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": ""},
    ],
]
# room for SCRIPT and its stop token (past the end of text: then whatever follows)
LENGTHS = ("sampling.max_new_tokens=16", "text.new_tokens=16", "output.rows_per_chunk=1")


@pytest.fixture(scope="module")
def scripted(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted_target(tiny_qwen3, SCRIPT, tmp_path_factory.mktemp("scripted"))


def scripted_target(tiny: Path, text: str, out: Path) -> Path:
    """`tiny` (tiny_qwen3) saved to `out` as a target that writes `text` (its tokens, each once)
    then `<|im_end|>` after CHAT[0]'s chat prompt or DOC."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    script = ids(tokenizer, text)
    chat_prompt = tokenizer.apply_chat_template(
        CHAT[0][:1], add_generation_prompt=True, tokenize=False
    )
    starts = {ids(tokenizer, chat_prompt)[-1], ids(tokenizer, DOC)[-1]}
    assert len(set(script)) == len(script) and not starts & set(script)
    chain = [*script, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed.zero_()
        head.zero_()
        for token in starts:
            embed[token, 0] = 1.0
        head[chain[0], 0] = 1.0
        for dim, (token, following) in enumerate(pairwise(chain), start=1):
            embed[token, dim] = 1.0
            head[following, dim] = 1.0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def data(tmp_path: Path, shape: str) -> Path:
    rows = {
        "chat": [{"messages": m} for m in CHAT],
        "text": [{"text": DOC}],
        "completion": [{"prompt": DOC, "completion": "x"}],
    }[shape]
    return write_jsonl(tmp_path / f"{shape}.jsonl", rows)


def extracted(model: Path, out: Path, tmp_path: Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each written row as extract tokenizes it."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prepared = prepare_documents(extract_config(model, out, tmp_path / "store").data, tokenizer)
    return [(d["input_ids"], d["loss_mask"]) for d in prepared.dataset]


@pytest.mark.parametrize(
    "shape,extra",
    [
        ("chat", ()),
        ("text", ()),
        ("text", ("text.loss_on_prompt=false",)),
        ("text", ("text.stop_at_eos=false",)),
        ("completion", ()),
    ],
    ids=["chat", "text", "text_split", "text_past_eos", "completion"],
)
def test_extract_reads_back_the_targets_reply_ids(
    scripted: Path, tmp_path: Path, shape: str, extra: tuple[str, ...]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    script, end = ids(tokenizer, SCRIPT), tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = tmp_path / "out"
    past = "text.stop_at_eos=false" in extra
    manifest = run_generate(config(scripted, data(tmp_path, shape), out, *LENGTHS, *extra))
    assert manifest is not None and manifest["counts"]["truncated"] == past
    rows = read_rows(out)
    docs = extracted(scripted, out, tmp_path)
    if shape == "chat":
        replies = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
        assert replies == [SCRIPT] * 3
        for input_ids, mask in docs:  # the loss tokens: each reply and its end of turn
            learned = [t for t, m in zip(input_ids, mask, strict=True) if m]
            assert learned == (script + [end]) * (len(learned) // (len(script) + 1))
        assert sum(map(sum, (m for _, m in docs))) == 3 * (len(script) + 1)
        return
    ((input_ids, mask),) = docs
    if past:  # on past the stop token: it is kept as text too
        doc = ids(tokenizer, DOC)
        assert input_ids[: len(doc) + len(script) + 1] == doc + script + [end]
        assert len(input_ids) == len(doc) + 16
        return
    # the stop token that ended the reply is written too (no template writes one here)
    assert input_ids == ids(tokenizer, DOC) + script + [end]
    split = shape == "completion" or "text.loss_on_prompt=false" in extra
    written = rows[0]["completion"] if split else rows[0]["text"][len(DOC) :]
    assert written == SCRIPT + "<|im_end|>"
    assert sum(mask) == (len(script) + 1 if split else len(input_ids))


@pytest.mark.parametrize("shape", ["chat", "text", "completion"])
@pytest.mark.parametrize("return_ids", [True, False], ids=["ids", "no_ids"])
def test_openai_backend_keeps_them_as_the_local_one(
    scripted: Path, tmp_path: Path, shape: str, return_ids: bool
) -> None:
    """Through a server that leaves special tokens out unless asked (vLLM's default), the rows
    equal the local backend's: the requests ask for them."""
    source = data(tmp_path, shape)
    extra = [*LENGTHS, "run.batch_size=1"]
    run_generate(config(scripted, source, tmp_path / "local", *extra))
    with OpenAIServer(scripted, return_ids=return_ids) as server:
        remote = [f"endpoint.url={server.url}", "run.backend=openai", "endpoint.concurrency=2"]
        run_generate(config(scripted, source, tmp_path / "remote", *extra, *remote))
    rows = read_rows(tmp_path / "remote")
    assert rows == read_rows(tmp_path / "local")
    assert "<|endoftext|>" in json.dumps(rows)
    assert all(r["skip_special_tokens"] is False for r in server.requests)


def _as_older_version(out: Path, complete: bool) -> None:
    """Rewrite `out`'s manifest as a version before REPLY_SPECIALS wrote it."""
    manifest = read_manifest(out)
    manifest["content"].pop(REPLY_SPECIALS, None)
    manifest.update(key=content_key(manifest["content"]), complete=complete)
    manifest_path(out).write_text(json.dumps(manifest, indent=2))


def test_an_older_versions_unfinished_output_is_not_resumed(scripted: Path, tmp_path: Path) -> None:
    """Its chunks left out what this version's keep: a resume would mix both, so it is refused
    naming the fix; a finished one (nothing left to mix) reruns as a no-op."""
    source = write_jsonl(tmp_path / "text.jsonl", [{"text": DOC}, {"text": "import os"}])
    out = tmp_path / "out"
    cfg = config(scripted, source, out, *LENGTHS)
    first = run_generate(cfg)
    assert first["content"][REPLY_SPECIALS] == "kept"
    before = read_rows(out)
    _as_older_version(out, complete=True)
    again = run_generate(cfg)
    assert REPLY_SPECIALS not in again["content"] and read_rows(out) == before
    _as_older_version(out, complete=False)
    (out / ".dflash-generate" / "chunk-000001.json").unlink()
    with pytest.raises(ValueError, match=r"older dflash-offline.*new --out.*--overwrite"):
        run_generate(cfg)
    overwrite = config(scripted, source, out, *LENGTHS, "output.overwrite=true")
    assert run_generate(overwrite)["content"][REPLY_SPECIALS] == "kept"
    assert read_rows(out) == before


def test_past_the_end_of_text_the_key_is_unchanged(scripted: Path, tmp_path: Path) -> None:
    """text.stop_at_eos=false kept every special token already: its rows and key are those of
    older versions, which resume."""
    source = data(tmp_path, "text")
    manifest = run_generate(config(scripted, source, tmp_path / "out", "text.stop_at_eos=false"))
    assert REPLY_SPECIALS not in manifest["content"]
