"""Audit of `dflash generate` on edge cases of real data: a conversation opening with an
assistant turn, prompts longer than the target's positions, and extract on an unfinished
output folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_generate import config, read_rows, write_jsonl

from common.config import build_config
from common.generated import manifest_path
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract
from stage1_generate.run import run_generate

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


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


@pytest.fixture(scope="module")
def tiny_short(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with only 48 positions."""
    folder = tmp_path_factory.mktemp("tiny-short") / "model"
    shutil.copytree(tiny_qwen3, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": 48}))
    return folder


def test_prompt_past_the_target_positions_is_invalid(tiny_short: Path, tmp_path: Path) -> None:
    """A prompt that with max_new_tokens exceeds max_position_embeddings is refused (or
    skipped), never generated past the positions the target knows."""
    long_question = "tell me about the quick brown fox " * 12
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {
            "messages": [
                {"role": "user", "content": long_question},
                {"role": "assistant", "content": "ok"},
            ]
        },
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"row 1: the prompt has \d+ tokens.*max_position_embeddings \(48\)"
    ):
        run_generate(config(tiny_short, data, tmp_path / "out"))
    manifest = run_generate(config(tiny_short, data, tmp_path / "out", "data.on_invalid=skip"))
    assert manifest["counts"]["skipped"] == {"too_long": 1}
    assert [r["source_index"] for r in read_rows(tmp_path / "out")] == [0]

    completions = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": long_question, "completion": "x"}])
    with pytest.raises(ValueError, match=r"row 0: the prompt has \d+ tokens"):
        run_generate(config(tiny_short, completions, tmp_path / "out-pc"))

    text = write_jsonl(tmp_path / "text.jsonl", [{"text": long_question}])
    with pytest.raises(ValueError, match=r"text.prompt_tokens 40 \+ text.new_tokens 10 exceed"):
        run_generate(
            config(
                tiny_short, text, tmp_path / "out-t", "text.prompt_tokens=40", "text.new_tokens=10"
            )
        )


def test_extract_refuses_an_unfinished_generate_folder(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A generate run killed before its last chunk leaves a folder extract used to read as
    if complete (a store silently missing rows); now refused with the fix."""
    rows = [{"text": f"line {i} of some text to continue"} for i in range(4)]
    data = write_jsonl(tmp_path / "text.jsonl", rows)
    out = tmp_path / "gen"
    run_generate(config(tiny_qwen3, data, out))
    path = manifest_path(out)
    path.write_text(json.dumps({**json.loads(path.read_text()), "complete": False}))
    sets = [f"target.model={tiny_qwen3}", f"data.path={out}", f"store.out={tmp_path / 'store'}"]
    cfg = build_config(ExtractConfig, DEBUG, "extract", [*sets, "run.progress=false"])
    with pytest.raises(ValueError, match=r"unfinished `dflash generate` folder.*rerun the same"):
        run_extract(cfg)
    assert not (tmp_path / "store").exists()
