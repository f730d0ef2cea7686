"""Rough edges of `dflash evaluate`, `inspect --sample` and `plot` a review found: a count cut
to what the data holds is said, and a path in the way is named with the fix before the work."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from log_capture import dflash_messages


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
