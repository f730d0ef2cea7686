"""Review (positions): extract and generate against the target's trained positions.

A packed sequence or a generated row longer than the target's max positions gives its hidden
states and logits out-of-distribution positions (RoPE extrapolation) without any error: the
drafter would train on garbage features. `dflash extract` refuses a `packing.seq_len` past
them before loading the weights; `dflash generate` refuses settings that no row could fit
before loading the weights, and rows past them stay invalid rows (`too_long`). Rope scaling in
the config extends the limit (factor x original positions); a config that names no limit is
not checked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_extract import make_config, write_data
from test_generate import config as generate_config
from test_generate import read_rows, write_jsonl
from transformers import GPT2Config, LlamaConfig, PretrainedConfig, Qwen3Config

import stage1_extract.job
import stage1_extract.run
import stage1_extract.target
from common.store import open_store
from stage1_extract.run import run_extract
from stage1_extract.target import max_positions
from stage1_generate.config import GenerateConfig
from stage1_generate.rows import check_settings
from stage1_generate.run import run_generate


def _with_config(source: Path, folder: Path, **changes: Any) -> Path:
    """A copy of the tiny target at `folder` whose config.json has `changes`."""
    shutil.copytree(source, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def _no_weights(monkeypatch: pytest.MonkeyPatch, tokenizer_too: bool = True) -> None:
    """Fail the test if the target's weights (or its tokenizer: extract refuses from the
    config alone) are loaded."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("loaded past the point where the settings were refused")

    monkeypatch.setattr(stage1_extract.run, "load_target", refuse)
    monkeypatch.setattr(stage1_extract.target, "load_target", refuse)
    if tokenizer_too:
        monkeypatch.setattr(stage1_extract.job, "load_tokenizer", refuse)


# ---------------------------------------------------------------- the limit a config gives


def test_max_positions_of_plain_configs() -> None:
    found = max_positions(Qwen3Config(max_position_embeddings=64))
    assert (found.limit, found.source) == (64, "max_position_embeddings")
    # GPT-2 names it n_positions; transformers maps max_position_embeddings onto it
    assert max_positions(GPT2Config(n_positions=96)).limit == 96
    assert max_positions(PretrainedConfig()) is None


def test_rope_scaling_extends_the_limit() -> None:
    """factor x original_max_position_embeddings when that is more than
    max_position_embeddings (Qwen2.5/Qwen3's yarn recipe); max_position_embeddings when it
    already is the scaled length (Llama 3.1: 131072 = 16 x 8192, factor 8)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    found = max_positions(Qwen3Config(max_position_embeddings=40960, rope_scaling=yarn))
    assert found.limit == 131072 and found.source == "positions under yarn rope scaling x4"
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    found = max_positions(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3))
    assert (found.limit, found.source) == (131072, "max_position_embeddings")
    # no original given: transformers scales from max_position_embeddings itself
    linear = {"rope_type": "linear", "factor": 2.0}
    assert max_positions(LlamaConfig(max_position_embeddings=64, rope_scaling=linear)).limit == 128


# ---------------------------------------------------------------- extract


def test_extract_refuses_seq_len_past_the_target_positions(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=48)
    _no_weights(monkeypatch)
    cfg = make_config(target, write_data(tmp_path), tmp_path / "store")  # seq_len 64
    with pytest.raises(ValueError) as info:
        run_extract(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("packing.seq_len=64 is more than ")
    assert "max_position_embeddings (48)" in message
    assert "--set packing.seq_len=48" in message
    assert not (tmp_path / "store").exists()


def test_extract_accepts_seq_len_equal_to_the_target_positions(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=64)
    run_extract(make_config(target, write_data(tmp_path), tmp_path / "store"))
    assert open_store(tmp_path / "store").attrs["complete"]


def test_extract_accepts_rope_scaled_positions(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 positions x linear factor 2 hold a 64-token sequence; x factor 1.5 do not (the
    config.json key transformers 5 writes: rope_parameters)."""
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}
    target = _with_config(
        tiny_qwen3, tmp_path / "target", max_position_embeddings=32, rope_parameters=scaled
    )
    run_extract(make_config(target, write_data(tmp_path), tmp_path / "store"))
    assert open_store(tmp_path / "store").attrs["complete"]

    short = {**scaled, "factor": 1.5}
    target = _with_config(
        tiny_qwen3, tmp_path / "target-short", max_position_embeddings=32, rope_parameters=short
    )
    _no_weights(monkeypatch)
    with pytest.raises(ValueError, match=r"linear rope scaling x1.5 \(48\).*seq_len=48"):
        run_extract(make_config(target, write_data(tmp_path), tmp_path / "store-short"))


def test_extract_accepts_a_config_without_max_positions(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that names no position limit (a recurrent model's, say) is not checked."""
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=48)
    load = stage1_extract.job.load_target_config

    def without_limit(cfg: Any, *named: str) -> PretrainedConfig:
        config = load(cfg, *named)  # named: how the user gave the model (--model or the key)
        del config.max_position_embeddings
        return config

    monkeypatch.setattr(stage1_extract.job, "load_target_config", without_limit)
    run_extract(make_config(target, write_data(tmp_path), tmp_path / "store"))
    assert open_store(tmp_path / "store").attrs["complete"]


# ---------------------------------------------------------------- generate


def _settings(*extra: str) -> GenerateConfig:
    return generate_config(Path("m"), Path("d"), Path("o"), *extra)


def test_generate_settings_check() -> None:
    """Text windows: the tokens the tokenizer puts first (a BOS) count too; chat and
    completion rows: max_new_tokens must leave room for a prompt of one token at least."""
    cfg = _settings("text.prompt_tokens=40", "text.new_tokens=10")
    check_settings(cfg, "text", 50, "the target's max_position_embeddings", 0)
    with pytest.raises(ValueError, match=r"40 \+ text.new_tokens 10 \+ 1 token the tokenizer"):
        check_settings(cfg, "text", 50, "the target's max_position_embeddings", 1)
    check_settings(cfg, "text", None, "none", 1)
    cfg = _settings("sampling.max_new_tokens=50")
    check_settings(cfg, "messages", 51, "the target's max_position_embeddings", 0)
    for fmt in ("messages", "sharegpt", "completion"):
        with pytest.raises(
            ValueError,
            match=r"sampling.max_new_tokens 50 leaves no room for a prompt within the "
            r"target's max_position_embeddings \(50\)",
        ):
            check_settings(cfg, fmt, 50, "the target's max_position_embeddings", 0)


def test_generate_refuses_settings_past_the_positions_before_loading(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=16)
    _no_weights(monkeypatch, tokenizer_too=False)  # generate reads the rows with it first
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
    )
    with pytest.raises(ValueError, match=r"sampling.max_new_tokens 16 leaves no room"):
        run_generate(generate_config(target, chat, tmp_path / "out", "sampling.max_new_tokens=16"))
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "the quick brown fox " * 8}])
    with pytest.raises(ValueError, match=r"text.prompt_tokens 12 \+ text.new_tokens 5 exceed"):
        run_generate(generate_config(target, text, tmp_path / "out-t"))


def test_generate_accepts_windows_that_fill_the_positions(tiny_qwen3: Path, tmp_path: Path) -> None:
    """prompt_tokens + new_tokens == max_position_embeddings (no BOS here) generates."""
    target = _with_config(tiny_qwen3, tmp_path / "target", max_position_embeddings=17)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "the quick brown fox " * 8}])
    manifest = run_generate(generate_config(target, text, tmp_path / "out"))
    assert manifest["complete"] and read_rows(tmp_path / "out")
