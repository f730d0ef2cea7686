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


def test_evaluate_refuses_a_folder_where_the_plot_beside_json_out_goes(tmp_path: Path) -> None:
    """--json-out X.json draws X.png beside it: a folder there failed once every prompt was
    measured ('Is a directory'), the figures neither printed nor written."""
    (tmp_path / "figures.png").mkdir()
    value = str(tmp_path / "figures.json")
    args = ["evaluate", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "d.jsonl")]
    code, out = _run(*args, "--json-out", value)
    assert code == 2, out
    assert "Invalid value for '--json-out'" in out and f"at {tmp_path / 'figures.png'}," in out
    assert "which is a folder; pass --plot FILE" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.png"]
    # a --plot of its own draws nowhere near it: that folder is no matter (the missing
    # --target is the error then)
    code, out = _run(*args, "--json-out", value, "--plot", str(tmp_path / "other.png"))
    assert code == 2 and "which is a folder" not in out and "--target" in out, out


def test_plot_names_a_file_where_the_plots_folder_goes(tmp_path: Path) -> None:
    """RUN/plots as a file failed as a bare 'File exists: RUN/plots'."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (tmp_path / "plots").write_text("")
    code, out = _run("plot", str(tmp_path))
    assert code == 2, out
    assert f"{tmp_path / 'plots'} is a file, not a folder" in out
    assert "move or remove that file" in out, out
