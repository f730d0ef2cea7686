"""Audit of `dflash generate` on edge cases of real data: a conversation opening with an
assistant turn, prompts longer than the target's positions, and extract on an unfinished
output folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_generate import config, read_rows, write_jsonl

from stage1_generate.run import run_generate


def test_leading_assistant_turn_is_named(tiny_qwen3: Path, tmp_path: Path) -> None:
    """An assistant turn with nothing before it cannot be rewritten: one clear error naming
    the row and the fix (not the template's "empty conversation"), and under skip the row is
    skipped with its own reason."""
    rows = [
        {
            "messages": [
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "hi"},
            ]
        },
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 0: message 0 is an assistant turn.*user or system"):
        run_generate(config(tiny_qwen3, data, tmp_path / "out"))
    manifest = run_generate(config(tiny_qwen3, data, tmp_path / "out", "data.on_invalid=skip"))
    assert manifest["counts"]["skipped"] == {"assistant_first": 1}
    assert [r["source_index"] for r in read_rows(tmp_path / "out")] == [1]
