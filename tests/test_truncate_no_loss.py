"""`packing.overlong=truncate` and rows whose loss tokens all lie past the first `seq_len`: a row
truncation leaves without a loss token is invalid (`no_loss_tokens_after_truncation`), as a row
that has none at all is: skipped and counted under `data.on_invalid=skip`, refused naming the
row and the fix without it. A truncated row that keeps a loss token is stored; under `split` the
same row is kept whole, its pieces without loss among them. A store begun when such rows were
kept is not resumed with new shards: the rerun's refusal names the cause."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_extract import cli_extract, shard_arrays
from transformers import AutoTokenizer

from common.store import committed_shards, open_store
from stage1_extract import data

S = 64  # test_extract's packing.seq_len
SKIP, TRUNCATE = "data.on_invalid=skip", "packing.overlong=truncate"
SHORT = {"prompt": "What is a prime number?", "completion": " A number with two divisors."}
PROMPT_PAST_S = {"prompt": "import os\n" * 40, "completion": " import sys"}  # row 1
CUT_WITH_LOSS = {"prompt": "the quick brown fox " * 4, "completion": " jumps over the dog " * 16}
COLOR = {"prompt": "Name a color.", "completion": " Red."}
ROWS = [SHORT, PROMPT_PAST_S, CUT_WITH_LOSS, COLOR]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def completion_lengths(tiny_qwen3: Path, row: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a completion row (the tiny tokenizer adds none)."""
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    prompt = len(tok(row["prompt"])["input_ids"])
    return prompt, len(tok(row["completion"], add_special_tokens=False)["input_ids"])


def documents(store: Path) -> list[dict[str, np.ndarray]]:
    return [shard_arrays(store, i) for i in committed_shards(store)]


@pytest.fixture(scope="module")
def stores(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Under truncate: every row, and the rows without the one whose prompt passes S; under
    split: every row."""
    folder = tmp_path_factory.mktemp("truncate-no-loss")
    every = write_rows(folder / "every.jsonl", ROWS)
    kept = write_rows(folder / "kept.jsonl", [r for r in ROWS if r is not PROMPT_PAST_S])
    out = {}
    for name, rows, extra in [
        ("truncate", every, [TRUNCATE]),
        ("truncate_without_row_1", kept, [TRUNCATE]),
        ("split", every, []),
    ]:
        result = cli_extract(tiny_qwen3, rows, folder / name, SKIP, *extra)
        assert result.exit_code == 0, result.output
        out[name] = folder / name
    return out


def test_a_prompt_past_seq_len_is_skipped_and_the_rest_stored_as_before(
    tiny_qwen3: Path, stores: dict[str, Path]
) -> None:
    assert completion_lengths(tiny_qwen3, PROMPT_PAST_S)[0] > S
    prompt, completion = completion_lengths(tiny_qwen3, CUT_WITH_LOSS)
    assert prompt < S < prompt + completion
    a = open_store(stores["truncate"]).attrs
    b = open_store(stores["truncate_without_row_1"]).attrs
    assert a["counts"]["skipped_rows"] == {data.NO_LOSS_KEPT: 1}
    assert "skipped_rows" not in b["counts"]
    # the rest is the store of the data without that row: the same counts (the truncated row
    # 2 among them, its loss tokens kept), documents and values, each row at its own number
    assert a["counts"] == {**b["counts"], "skipped_rows": {data.NO_LOSS_KEPT: 1}}
    assert a["counts"]["truncated_documents"] == 1
    assert a["counts"]["dropped_tokens"] == prompt + completion - S
    assert a["fingerprints"]["documents_sha256"] == b["fingerprints"]["documents_sha256"]
    renumbered = np.array([0, 2, 3])
    shards_a, shards_b = documents(stores["truncate"]), documents(stores["truncate_without_row_1"])
    assert len(shards_a) == len(shards_b)
    for x, y in zip(shards_a, shards_b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            want = renumbered[y[name]] if name == "doc_source_index" else y[name]
            np.testing.assert_array_equal(x[name], want, err_msg=name)
    stored = {}
    for x in shards_a:
        for seq, start, length, row in zip(
            x["doc_sequence"], x["doc_start"], x["doc_length"], x["doc_source_index"], strict=True
        ):
            stored[int(row)] = int(x["loss_mask"][seq, start : start + length].sum())
    assert sorted(stored) == [0, 2, 3] and stored[2] == S - prompt
    # split keeps the row: its pieces, the ones without loss too
    c = open_store(stores["split"]).attrs
    assert "skipped_rows" not in c["counts"] and c["counts"]["source_documents"] == len(ROWS)
    pieces = [
        int(x["loss_mask"][seq, start : start + length].sum())
        for x in documents(stores["split"])
        for seq, start, length, row in zip(
            x["doc_sequence"], x["doc_start"], x["doc_length"], x["doc_source_index"], strict=True
        )
        if row == 1
    ]
    assert len(pieces) > 1 and 0 in pieces and sum(pieces) > 0


def test_without_skip_the_row_and_the_fix_are_named(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A chat row whose user turn passes S: refused, nothing written; the truncated row 0
    before it, whose reply starts within S, is not."""
    reply = {"role": "assistant", "content": "Four. " * 60}
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}, reply]},
        {"messages": [{"role": "user", "content": "Why? " * 60}, reply]},
    ]
    out = tmp_path / "store"
    result = cli_extract(tiny_qwen3, write_rows(tmp_path / "chat.jsonl", rows), out, TRUNCATE)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "chat.jsonl row 1:" in message
    assert f"packing.overlong=truncate keeps its first {S} (packing.seq_len)" in message
    assert "(1 such row(s) in all)" in message
    assert "--set packing.overlong=split" in message and "data.on_invalid=skip" in message
    assert not out.exists()


def test_a_store_begun_keeping_such_rows_is_not_resumed(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rerun on a store written as versions before this one wrote it (the row kept): refused,
    naming the cause, its shards untouched."""
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "store"
    with monkeypatch.context() as m:
        m.setattr(data, "_no_loss_kept", lambda docs, keep: [])
        result = cli_extract(tiny_qwen3, path, out, SKIP, TRUNCATE)
    assert result.exit_code == 0, result.output
    assert open_store(out).attrs["counts"]["source_documents"] == len(ROWS)
    before = documents(out)
    result = cli_extract(tiny_qwen3, path, out, SKIP, TRUNCATE)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "was written with other settings or data" in message
    assert "kept rows whose first seq_len tokens hold no loss token" in message
    assert data.NO_LOSS_KEPT in message and "--overwrite" in message
    for x, y in zip(documents(out), before, strict=True):
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)
