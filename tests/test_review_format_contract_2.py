"""FORMAT.md as a contract, the cases test_review_format_contract leaves out, read by its reader
(FORMAT.md's words alone) and checked by its checks: an nvfp4 store of text rows (decoded by
the words, against a fresh forward within the format's precision and against the code's
readers).

Legend: L tokens of a document, D hidden size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import test_review_format_contract as contract
import test_review_nvfp4_contract as nvfp4
import torch
from test_extract import cli_extract
from transformers import AutoModelForCausalLM, AutoTokenizer

# one token each (the tiny tokenizer), so a text of n of them is n tokens
WORDS = ["the", "is", "a", "of", "and", "to", "in", "it", "that", "for", "with", "can"]
TIE_LENGTHS = [50, 34, 50, 16, 10, 8]
EMPTY_TEXTS = ["", "   \n", None]  # skipped: FORMAT.md's `empty_text`
F32 = np.float32


def words(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def stores(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("format-contract-2")
    texts = [words(n) for n in TIE_LENGTHS] + contract.SMALL_TEXTS
    text_rows = [{"text": t} for t in texts[:3] + EMPTY_TEXTS + texts[3:]]
    text = folder / "text.jsonl"
    text.write_text("".join(json.dumps(r) + "\n" for r in text_rows))
    sets = {
        "text_nvfp4": (text, ["store.hidden_dtype=nvfp4"]),
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
    return model, {"text_nvfp4": AutoTokenizer.from_pretrained(tiny_qwen3)}


NAMES = ["text_nvfp4"]


@pytest.mark.parametrize("name", NAMES)
def test_values_equal_a_fresh_forward_of_each_document(stores, target, name: str) -> None:
    """nvfp4 features decoded by the words within the format's precision; the verifier arrays
    as a fresh forward of each stored piece gives them."""
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
