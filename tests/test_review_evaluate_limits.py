"""Review (evaluate's positions): a prompt and its reply within the target's positions.

Past its max positions a rotary target runs on without an error, out of what it was trained
on, and `dflash evaluate` would measure tau there. It refuses `--new-tokens` that leaves no
room for a prompt before anything loads, and a prompt whose tokens + `--new-tokens` pass the
limit before the target's weights load, naming the row and the `--prompt-tokens` that fits
(prompts are never cut silently). A prompt exactly at the limit runs, and no forward of the
target, verification drafts included, goes past it: drafts are cut there, as a server cuts
them. The limit is `max_positions` (extract's and generate's: the attribute or an alias,
raised by rope scaling), and the exported drafter's max_position_embeddings is the same
(tested in test_model.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

import stage2_train.export
from dflash_offline.cli import main
from evaluation.online import EvaluateConfig, run_evaluate
from stage2_train.config import DrafterConfig
from stage2_train.export import export_drafter
from stage2_train.model import DFlashDrafter, drafter_shape

TEXTS = ["def f(x):\n    return x\n", "import os\n" * 3, "class A:\n    pass\n" * 2]
LIMIT = 32  # max_position_embeddings of the targets here


def _with_config(source: Path, folder: Path, **changes: Any) -> Path:
    """A copy of the tiny target at `folder` whose config.json has `changes`."""
    shutil.copytree(source, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "dev.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    return path


def _lengths(target: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(target)
    return [len(tokenizer(text)["input_ids"]) for text in TEXTS]


def _no_weights(monkeypatch: pytest.MonkeyPatch, tokenizer_too: bool = False) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("loaded past the point where the settings were refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    if tokenizer_too:
        monkeypatch.setattr(stage2_train.export, "load_export", refuse)
        monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)


def _export(target: Path, folder: Path, block_size: int = 4) -> Path:
    config = AutoModelForCausalLM.from_pretrained(target).config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=block_size), config, 2, config["vocab_size"], 3
    )
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(shape), shape, [0, 2], config, folder)


def test_new_tokens_alone_past_the_limit_is_refused_before_anything_loads(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=LIMIT)
    _no_weights(monkeypatch, tokenizer_too=True)
    cfg = EvaluateConfig(str(target), str(_data(tmp_path)), drafter="x", new_tokens=LIMIT)
    with pytest.raises(ValueError) as info:
        run_evaluate(cfg)
    assert str(info.value) == (
        f"--new-tokens 32 leaves no room for a prompt within {target}'s "
        "max_position_embeddings (32): every prompt with its reply would run past them; "
        "lower --new-tokens below 32"
    )
    result = CliRunner().invoke(
        main, ["evaluate", "--target", str(target), "--data", "d", "--new-tokens", "40"]
    )
    assert result.exit_code == 2
    assert "--new-tokens 40 leaves no room" in result.output
    assert "max_position_embeddings (32)" in result.output


def test_a_prompt_past_the_limit_is_refused_naming_the_row_and_the_fix(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows 1 and 2 are longer than row 0: with --new-tokens that leaves room for row 0 only,
    row 1 is named (and one more counted) before the target's weights load; the
    --prompt-tokens the message names then runs."""
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=LIMIT)
    lengths = _lengths(target)
    assert lengths[0] < min(lengths[1:]) and max(lengths) < LIMIT
    new = LIMIT - lengths[0]
    data = _data(tmp_path)
    cfg = EvaluateConfig(str(target), str(data), new_tokens=new, stop_at_eos=False)
    with monkeypatch.context() as patch:
        _no_weights(patch)
        with pytest.raises(ValueError) as info:
            run_evaluate(cfg)
    assert str(info.value) == (
        f"--data {data} row 1: the prompt has {lengths[1]} tokens, which with --new-tokens "
        f"{new} exceed {target}'s max_position_embeddings (32) (and 1 more prompt); pass "
        f"--prompt-tokens {lengths[0]} or lower (every prompt cut to that many tokens), or "
        "lower --new-tokens"
    )
    cfg.prompt_tokens = lengths[0]
    figures = run_evaluate(cfg)
    assert figures["num_prompts"] == 3
    assert figures["prompt_lookup"]["new_tokens"] == 3 * new


def test_rope_scaling_raises_the_limit(tiny_qwen3: Path, tmp_path: Path) -> None:
    """16 positions x linear factor 2: a prompt + reply of 32 tokens fit, of 33 are refused
    under the scaled limit's name."""
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}
    target = _with_config(
        tiny_qwen3, tmp_path / "target", max_position_embeddings=16, rope_parameters=scaled
    )
    new = LIMIT - _lengths(target)[0]
    data = str(_data(tmp_path))
    cfg = EvaluateConfig(str(target), data, num_prompts=1, new_tokens=new, stop_at_eos=False)
    assert run_evaluate(cfg)["prompt_lookup"]["new_tokens"] == new
    cfg.new_tokens += 1
    with pytest.raises(ValueError, match=r"positions under linear rope scaling x2 \(32\)"):
        run_evaluate(cfg)


def test_a_prompt_exactly_at_the_limit_stays_within_the_positions(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prompt + --new-tokens == max_position_embeddings runs to its whole budget, and no
    target forward runs past position 31: the DFlash drafter proposes 3 tokens every step,
    which uncut would run the last verifications to position 33."""
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=LIMIT)
    export = _export(target, tmp_path / "export")
    new = LIMIT - _lengths(target)[0]
    reached: list[int] = []

    def record(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        reached.append(cache.get_seq_length() + ids.size(1) - 1)  # the last position run

    load = AutoModelForCausalLM.from_pretrained

    def hooked(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = load(*args, **kwargs)
        model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", hooked)
    cfg = EvaluateConfig(
        str(target),
        str(_data(tmp_path)),
        drafter=str(export),
        num_prompts=1,
        new_tokens=new,
        stop_at_eos=False,
    )
    figures = run_evaluate(cfg)
    for method in ("prompt_lookup", "dflash"):
        assert figures[method]["new_tokens"] == new
    assert max(reached) == LIMIT - 1
