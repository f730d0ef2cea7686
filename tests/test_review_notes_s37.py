"""Rough edges of `dflash evaluate`, `inspect --sample` and `plot` a review found: a count cut
to what the data holds is said, and a path in the way is named with the fix before the work."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from click.testing import CliRunner
from inspect_fixtures import build_store
from log_capture import dflash_messages

from dflash_offline.cli import main as cli


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, " ".join(result.output.split())


def test_evaluate_says_when_the_data_has_fewer_prompts_than_asked(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """--num-prompts 5 on a file of 2 rows measured 2 prompts, said only by the JSON's
    num_prompts."""
    from transformers import AutoTokenizer

    from evaluation.online import EvaluateConfig, load_prompts

    data = tmp_path / "dev.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} says hello"}) + "\n" for i in range(2)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    with dflash_messages(logging.WARNING) as seen:
        prompts = load_prompts(EvaluateConfig(str(tiny_qwen3), str(data), num_prompts=5), tokenizer)
    assert len(prompts) == 2
    [warning] = [m for m in seen if "--num-prompts" in m]
    assert f"--num-prompts 5 asks for more prompts than --data {data} has (2 rows)" in warning
    assert "all 2 are used" in warning
    with dflash_messages(logging.WARNING) as seen:
        load_prompts(EvaluateConfig(str(tiny_qwen3), str(data), num_prompts=2), tokenizer)
    assert not [m for m in seen if "--num-prompts" in m], seen


def test_inspect_says_when_sample_asks_past_the_store(tmp_path: Path) -> None:
    """--sample 10 on a store of 3 sequences decoded the 3 without a note."""
    store = str(build_store(tmp_path / "store").path)
    code, out = _run("inspect", store, "--sample", "10")
    assert code == 0, out
    assert "note: --sample 10 asks for more sequences than the store has (3): showing 3" in out
    assert out.count("=== sequence") == 3
    code, out = _run("inspect", store, "--sample", "3")
    assert code == 0 and "asks for more sequences" not in out, out
