"""`dflash generate`'s sampling.top_k: a draw from the k most likely tokens only, before top_p,
as servers sample a target whose generation_config.json sets it (Qwen3's top_k 20).

The local backend must pass it to transformers' sampling (top_k 1 at any temperature writes
the greedy rows; without it, sampling at that temperature writes others), and the OpenAI
backend must ask the server for it instead of leaving every token (-1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_generate import TEXTS, chat_rows, config, digests, write_jsonl
from test_generate_openai import OpenAIServer

from stage1_generate import openai_backend
from stage1_generate.config import EndpointConfig, SamplingConfig
from stage1_generate.run import run_generate


@pytest.mark.parametrize("shape", ["text", "chat"])
def test_top_k_one_samples_the_greedy_rows(tiny_qwen3: Path, tmp_path: Path, shape: str) -> None:
    rows = [{"text": t} for t in TEXTS] if shape == "text" else chat_rows()
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    hot = "sampling.temperature=1.5"
    run_generate(config(tiny_qwen3, data, tmp_path / "greedy"))
    run_generate(config(tiny_qwen3, data, tmp_path / "top1", hot, "sampling.top_k=1"))
    run_generate(config(tiny_qwen3, data, tmp_path / "all", hot))
    greedy = digests(tmp_path / "greedy")
    assert greedy and digests(tmp_path / "top1") == greedy
    assert digests(tmp_path / "all") != greedy  # the temperature alone writes other rows


def test_top_k_is_asked_of_the_server(tiny_qwen3: Path) -> None:
    sampling = SamplingConfig(temperature=0.6, top_p=0.95, top_k=20)
    with OpenAIServer(tiny_qwen3, served_name="tiny") as server:
        endpoint = EndpointConfig(url=server.url, model="tiny")
        backend = openai_backend.OpenAIBackend(endpoint, sampling, [0], "unused")
        backend.generate([[5, 6, 7]], 2)
    (request,) = server.requests
    assert (request["temperature"], request["top_p"], request["top_k"]) == (0.6, 0.95, 20)


def test_a_negative_top_k_is_refused(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows())
    with pytest.raises(ValueError, match=r"top_k must be >= 0 \(0: every token\), got -2"):
        config(tiny_qwen3, data, tmp_path / "out", "sampling.top_k=-2")


def test_inspect_says_the_top_k_a_folder_sampled_with() -> None:
    from common.inspect_store import _generation_rows

    def how(sampling: dict) -> str:
        content = {"target": {"model": "t"}, "sampling": {"max_new_tokens": 8, **sampling}}
        return _generation_rows({"content": content})[1][1]

    assert how({"temperature": 0.6, "top_p": 0.95, "top_k": 20}).startswith(
        "temperature 0.6, top-p 0.95, top-k 20,"
    )
    # a folder of every token: top_k 0 is left out of its content, as before the key existed
    assert how({"temperature": 0.6, "top_p": 0.95}).startswith("temperature 0.6, top-p 0.95,")
    assert how({"temperature": 0.0}).startswith("greedy")
