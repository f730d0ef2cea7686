"""`dflash evaluate --server-sampling`: the sampling vLLM and SGLang apply to a request that
sets none, read from the target's generation_config.json (where it sets a value apart from
transformers' defaults), else the servers' own defaults (temperature 1.0, every token); flags
given beside it win, and what the servers fill but evaluate does not model is warned of."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from log_capture import dflash_messages

from common.served_sampling import served_sampling
from dflash_offline.cli import main


def _target_with(tiny_qwen3: Path, tmp_path: Path, generation: dict | None) -> Path:
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    (target / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (target / "generation_config.json").write_text(json.dumps(generation))
    return target


QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}


def test_served_sampling_reads_what_the_generation_config_sets(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    assert served_sampling(str(_target_with(tiny_qwen3, tmp_path / "a", QWEN3_LIKE))) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.0,
    }
    qwen25 = {**QWEN3_LIKE, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}
    assert served_sampling(str(_target_with(tiny_qwen3, tmp_path / "q", qwen25))) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }
    # none set (or no file): the servers' defaults, not transformers' top_k 50
    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    assert (
        served_sampling(str(_target_with(tiny_qwen3, tmp_path / "b", {"eos_token_id": 2}))) == plain
    )
    assert served_sampling(str(_target_with(tiny_qwen3, tmp_path / "c", None))) == plain
    only_t = _target_with(tiny_qwen3, tmp_path / "d", {"temperature": 0.7})
    assert served_sampling(str(only_t)) == {**plain, "temperature": 0.7}


def test_unmodelled_settings_are_warned_of(tiny_qwen3: Path, tmp_path: Path) -> None:
    generation = {**QWEN3_LIKE, "min_p": 0.05}
    with dflash_messages(logging.WARNING) as seen:
        served_sampling(str(_target_with(tiny_qwen3, tmp_path / "a", generation)))
    assert any("sets min_p 0.05, which a server applies" in m for m in seen), seen
    with dflash_messages(logging.WARNING) as seen:
        served_sampling(str(_target_with(tiny_qwen3, tmp_path / "b", {**generation, "min_p": 0})))
    assert not any("min_p" in m for m in seen)  # 0: changes nothing


@pytest.mark.parametrize(
    ("flags", "sampling"),
    [
        ([], {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}),
        (
            ["--temperature", "0.9", "--top-k", "5", "--repetition-penalty", "1"],
            {"temperature": 0.9, "top_p": 0.95, "top_k": 5, "repetition_penalty": 1.0},
        ),
    ],
)
def test_evaluate_samples_as_served_and_flags_win(
    tiny_qwen3: Path, tmp_path: Path, flags: list[str], sampling: dict
) -> None:
    target = _target_with(tiny_qwen3, tmp_path, {**QWEN3_LIKE, "repetition_penalty": 1.1})
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 3}) + "\n")
    out = tmp_path / "served.json"
    args = ["evaluate", "--target", str(target), "--data", str(data), "--num-prompts", "1"]
    args += ["--new-tokens", "6", "--no-stop-at-eos", "--server-sampling", *flags]
    result = CliRunner().invoke(main, [*args, "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["sampling"] == {"seed": 0, "num_seeds": 1, **sampling}


def test_the_plot_title_names_the_sampling() -> None:
    from evaluation.plot import verification_title

    assert verification_title({}) == "greedy"
    assert verification_title({"temperature": 0.0, "top_k": 20}) == "greedy"
    assert verification_title({"temperature": 0.0, "repetition_penalty": 1.05}) == (
        "greedy, repetition penalty 1.05"
    )
    served = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.0}
    assert verification_title(served) == "sampled at temperature 0.6, top-p 0.95, top-k 20"
