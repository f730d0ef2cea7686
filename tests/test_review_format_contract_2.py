"""FORMAT.md as a contract, the cases test_review_format_contract leaves out, read by its reader
(FORMAT.md's words alone) and checked by its checks: an nvfp4 store (decoded by the words,
against a fresh forward within the format's precision and against the code's readers) of text
rows packed best-fit where equal rooms tie, with empty rows skipped (`data.on_invalid=skip`);
and a store of prompt/completion rows truncated to `seq_len` (`packing.overlong=truncate`), with
invalid rows skipped, through a tokenizer that puts a BOS before a text and appends an EOS.

Ground truth is computed here from the rows and the words: which rows are skipped and why, each
kept row's tokens and loss mask ("Tokens of a document"), the packing plan and the counts.

Legend: L tokens of a document, D hidden size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_review_format_contract as contract
import test_review_nvfp4_contract as nvfp4
import torch
from test_extract import cli_extract
from tokenizers import processors
from transformers import AutoModelForCausalLM, AutoTokenizer

# one token each (the tiny tokenizer), so a text of n of them is n tokens
WORDS = ["the", "is", "a", "of", "and", "to", "in", "it", "that", "for", "with", "can"]
# best fit at seq_len 64: sequences 0 and 2 reach room 14 (in that order), then 16 takes
# sequence 1 to 14 too: 10 goes to sequence 1 (the one that reached 14 last), 8 then to 2
TIE_LENGTHS = [50, 34, 50, 16, 10, 8]
EMPTY_TEXTS = ["", "   \n", None]  # skipped: FORMAT.md's `empty_text`
COMPLETION_ROWS: list[dict[str, Any]] = [
    {"prompt": "What is a prime number?", "completion": " A number with two divisors."},
    {"prompt": "Hi", "completion": ""},  # skipped: empty_completion
    {"prompt": "the quick brown fox " * 3, "completion": " jumps over the lazy dog " * 4},
    {"prompt": None, "completion": " Blue."},  # skipped: bad_prompt
    {"prompt": "", "completion": " Blue."},  # an empty prompt still gets the BOS
    # the prompt alone > 64: skipped, no_loss_tokens_after_truncation
    {"prompt": "import os\n" * 12, "completion": " import sys"},
    {"prompt": "2+2?", "completion": " \n "},  # skipped: empty_completion
    {"prompt": "Name a color.", "completion": " Red.<|im_end|>"},  # an end the data hold
]
BOS, EOS = "<|im_start|>", "<|im_end|>"
F32 = np.float32


def words(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


def skip_reason(row: dict[str, Any]) -> str | None:
    """FORMAT.md's reasons a row is skipped under data.on_invalid=skip (counts.skipped_rows)."""
    if "text" in row:
        return None if isinstance(row["text"], str) and row["text"].strip() else "empty_text"
    if not isinstance(row["prompt"], str):
        return "bad_prompt"
    completion = row["completion"]
    return None if isinstance(completion, str) and completion.strip() else "empty_completion"


def document(tokenizer, row: dict[str, Any], suffix: list[int]) -> tuple[list[int], list[int]]:
    """By "Tokens of a document": a text row is its text with what the tokenizer puts before a
    text, not what it appends (the root's `suffix_left_out`), loss on every token; a completion
    row is its prompt taken the same way, then the completion's own tokens, loss on those."""

    def text_ids(text: str) -> list[int]:
        ids = tokenizer(text)["input_ids"]
        return ids[: -len(suffix)] if suffix and ids[-len(suffix) :] == suffix else ids

    if "text" in row:
        ids = text_ids(row["text"])
        return ids, [1] * len(ids)
    prompt = text_ids(row["prompt"])
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


@pytest.fixture(scope="module")
def stores(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("format-contract-2")
    texts = [words(n) for n in TIE_LENGTHS] + contract.SMALL_TEXTS
    text_rows = [{"text": t} for t in texts[:3] + EMPTY_TEXTS + texts[3:]]
    text = folder / "text.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in text_rows))
    completion = folder / "completion.jsonl"
    completion.write_text("".join(json.dumps(r) + "\n" for r in COMPLETION_ROWS))
    # the tiny tokenizer with a BOS before every text and an EOS after it
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    ids = [(t, tokenizer.convert_tokens_to_ids(t)) for t in (BOS, EOS)]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=ids
    )
    tokenizer.save_pretrained(folder / "tokenizer")
    sets = {
        "text_nvfp4": (text, ["store.hidden_dtype=nvfp4"]),
        "completion_truncate": (
            completion,
            ["packing.overlong=truncate", f"target.tokenizer={folder / 'tokenizer'}"],
        ),
    }
    out = {}
    for name, (data, extra) in sets.items():
        layers = "target.tapped_layers=[0,1,3]"
        skip = "data.on_invalid=skip"
        result = cli_extract(tiny_qwen3, data, folder / name, layers, skip, *extra)
        assert result.exit_code == 0, result.output
        out[name] = folder / name
    return out


@pytest.fixture(scope="module")
def target(tiny_qwen3: Path, stores: dict[str, Path]):
    """The tiny target and, by store, the tokenizer it was extracted with."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    bos_eos = AutoTokenizer.from_pretrained(stores["completion_truncate"].parent / "tokenizer")
    return model, {
        "text_nvfp4": AutoTokenizer.from_pretrained(tiny_qwen3),
        "completion_truncate": bos_eos,
    }


NAMES = ["text_nvfp4", "completion_truncate"]


@pytest.mark.parametrize("name", NAMES)
def test_skipped_rows_documents_packing_and_counts(stores, target, name: str) -> None:
    """Which rows are skipped and why (`counts.skipped_rows`, by FORMAT.md's reasons), each kept
    row's tokens and loss mask at its `doc_source_index`, the pieces where the packing rules put
    them (truncated to `S` in the completion store) and the counts of both."""
    _, tokenizers = target
    tokenizer = tokenizers[name]
    store = contract.read_store(stores[name])
    a = store.attrs
    rows = contract.rows_of(store)
    reasons = [skip_reason(row) for row in rows]
    # the appended EOS is named, and left out of text and prompt alike
    suffix = a["tokenizer"].get("suffix_left_out", [])
    assert suffix == ([] if name == "text_nvfp4" else [tokenizer.convert_tokens_to_ids(EOS)])
    S = a["seq_len"]
    if name == "completion_truncate":  # a row whose first S tokens hold no loss token
        for r, row in enumerate(rows):
            if reasons[r] is None and not any(document(tokenizer, row, suffix)[1][:S]):
                reasons[r] = "no_loss_tokens_after_truncation"
    skipped: dict[str, int] = {}
    for reason in filter(None, reasons):
        skipped[reason] = skipped.get(reason, 0) + 1
    assert a["counts"]["skipped_rows"] == skipped
    assert a["dataset"]["num_rows"] == len(rows)
    assert a["dataset"]["format"] == ("text" if name == "text_nvfp4" else "completion")
    # documents keyed by their row of the input dataset, skipped rows counted there too
    docs = {r: document(tokenizer, row, suffix) for r, row in enumerate(rows) if reasons[r] is None}
    contract.check_packing(store, docs, tokenizer)
    if name == "completion_truncate":
        bos = tokenizer.convert_tokens_to_ids(BOS)
        assert all(ids[0] == bos for ids, _ in docs.values())
        eos = suffix[0]  # the completion's own <|im_end|>: kept, with loss, once
        ids, mask = docs[7]
        assert ids[-1] == eos != ids[-2] and mask[-1] == 1
        # what truncation leaves: row 2 its prompt and the start of its completion; row 5
        # its prompt's first S tokens, no loss token: skipped, not stored
        assert 0 < sum(docs[2][1][:S]) < sum(docs[2][1])
        ids5, mask5 = document(tokenizer, rows[5], suffix)
        assert len(ids5) > S and not any(mask5[:S]) and 5 not in docs
        assert reasons[5] == "no_loss_tokens_after_truncation"
        assert a["counts"]["truncated_documents"] == 1 and a["counts"]["split_documents"] == 0
        assert a["counts"]["dropped_tokens"] == len(docs[2][0]) - S


def test_best_fit_ties_go_to_the_sequence_that_reached_the_room_last(stores) -> None:
    """The tie rule decides the text store's plan: each other rule for equal rooms (first
    opened, last opened, reached first) would place its pieces otherwise; the store is the
    documented plan (test_skipped_rows_documents_packing_and_counts)."""
    store = contract.read_store(stores["text_nvfp4"])
    S = store.attrs["seq_len"]
    assert store.attrs["extract_config"]["packing"]["strategy"] == "best_fit"
    where, length = {}, {}
    for i, shard in enumerate(store.shards):
        x = shard.arrays
        for d in range(len(x["doc_length"])):
            key = (int(x["doc_source_index"][d]), int(x["doc_piece"][d]))
            seq = i * store.attrs["sequences_per_shard"] + int(x["doc_sequence"][d])
            where[key], length[key] = (seq, int(x["doc_start"][d])), int(x["doc_length"][d])
    # the tie rows, around the skipped empty ones
    first = [(r if r < 3 else r + len(EMPTY_TEXTS), 0) for r in range(len(TIE_LENGTHS))]
    assert [length[p] for p in first] == TIE_LENGTHS
    # 50, 34, 50 open sequences 0, 1, 2; 16 joins 1; 10 then 1 (reached 14 last); 8 then 2
    want = [(0, 0), (1, 0), (2, 0), (1, 34), (1, 50), (2, 50)]
    assert [where[p] for p in first] == want == tie_plan(TIE_LENGTHS, S, "reached_last")
    for other in ("first_opened", "last_opened", "reached_first"):
        assert tie_plan(TIE_LENGTHS, S, other) != tie_plan(TIE_LENGTHS, S, "reached_last"), other


def tie_plan(lengths: list[int], seq_len: int, rule: str) -> list[tuple[int, int]]:
    """(sequence, start) of each piece under best fit with `rule` among equal rooms."""
    room: list[int] = []
    reached: list[int] = []
    out = []
    for step, size in enumerate(lengths):
        fits = [s for s in range(len(room)) if room[s] >= size]
        if fits:
            least = [s for s in fits if room[s] == min(room[f] for f in fits)]
            pick = {
                "first_opened": min(least),
                "last_opened": max(least),
                "reached_first": min(least, key=lambda s: reached[s]),
                "reached_last": max(least, key=lambda s: reached[s]),
            }
            seq = pick[rule]
        else:
            seq = len(room)
            room.append(seq_len)
            reached.append(-1)
        out.append((seq, seq_len - room[seq]))
        room[seq] -= size
        reached[seq] = step
    return out


@pytest.mark.parametrize("name", NAMES)
def test_values_equal_a_fresh_forward_of_each_document(stores, target, name: str) -> None:
    """nvfp4 features decoded by the words within the format's precision (and fp8 under
    truncation); the verifier arrays as a fresh forward of each stored piece gives them."""
    model, _ = target
    contract.test_values_equal_a_fresh_forward_of_each_document(stores, (model, None), name)


def c6_squared_error(h_LD: np.ndarray) -> np.ndarray:
    """[L, D/16] squared error of each block under c6 alone, by "Hidden states"' encoder:
    c6 = float8_e4m3fn(min(a / 6 / scale, 448)), codes nearest h / (c6 * scale)."""
    L, D = h_LD.shape
    scale = np.abs(h_LD).max(-1, keepdims=True) / F32(6 * 448)
    scale = np.where(scale == 0, F32(1), scale).astype(F32)
    a = np.abs(h_LD).reshape(L, D // 16, 16).max(-1)
    c6 = nvfp4.e4m3_value(nvfp4.e4m3_bits(a / F32(6) / scale))
    s = np.repeat(c6, 16, axis=-1) * scale
    codes = nvfp4.block_codes(h_LD, s)
    value = np.where(codes & 8, F32(-1), F32(1)) * nvfp4.E2M1[codes & 7]
    wrong = (value * s).astype(np.float64) - h_LD.astype(np.float64)
    return np.square(wrong).reshape(L, D // 16, 16).sum(-1)


def test_nvfp4_blocks_err_no_more_than_c6_and_the_rms_is_the_formats(stores, target) -> None:
    """Beyond the bound: each block's squared error is at most c6's (FORMAT.md: the encoder
    keeps the least of six candidates, c6 first), up to the forward's noise, and the RMS error
    is of the size FORMAT.md gives (8.3% on pystd-28m's features; fp8's 2.6%)."""
    model, _ = target
    store = contract.read_store(stores["text_nvfp4"])
    wrong = c6_wrong = total = 0.0
    for shard in store.shards:
        x, hidden_nSKD = shard.arrays, store.hidden(shard)
        for seq, start, length in zip(
            x["doc_sequence"], x["doc_start"], x["doc_length"], strict=True
        ):
            span = slice(int(start), int(start) + int(length))
            ids = torch.from_numpy(x["tokens"][seq, span].astype(np.int64))[None]
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            for j, layer in enumerate(store.attrs["tapped_layers"]):
                want = out.hidden_states[layer + 1][0].numpy()
                L, D = want.shape
                got = np.square(hidden_nSKD[seq, span, j] - want).reshape(L, D // 16, 16).sum(-1)
                c6 = c6_squared_error(want)
                noise = (1e-5 * np.abs(want).max(-1, keepdims=True)) ** 2 * 16
                assert (got <= c6 * (1 + 1e-4) + noise).all(), layer
                wrong += float(got.sum())
                c6_wrong += float(c6.sum())
                total += float(np.square(want).sum())
    rms, c6_rms = (wrong / total) ** 0.5, (c6_wrong / total) ** 0.5
    assert 0.06 < rms < 0.095 and rms < c6_rms, (rms, c6_rms)


@pytest.mark.parametrize("name", NAMES)
def test_layout_head_and_the_codes_readers(stores, target, name: str) -> None:
    """The layout, the head file, and the code's readers (open_store, the loader's read_row and
    its nvfp4 decode) giving what the reader of the words gives."""
    model, tokenizers = target
    contract.check_layout_attributes_and_files(contract.read_store(stores[name]))
    contract.test_head_file_is_the_targets(stores, (model, tokenizers[name]), name)
    contract.test_the_codes_readers_read_the_same(stores, name)
