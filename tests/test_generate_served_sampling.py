"""`dflash generate`'s sampling.top_k and sampling.repetition_penalty: sampling as servers
sample a target whose generation_config.json sets them (Qwen3's top_k 20, Qwen2.5-Instruct's
repetition penalty 1.05).

top_k: the local backend must pass it to transformers' sampling (top_k 1 at any temperature
writes the greedy rows; without it, sampling at that temperature writes others), and the
OpenAI backend must ask the server for it instead of leaving every token (-1).
repetition_penalty: greedy rows too follow it, each row as if alone (left padding is not
penalized), as transformers' processor penalizes an unpadded row; the server is asked for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_generate import TEXTS, chat_rows, config, digests, write_jsonl
from test_generate_openai import OpenAIServer
from test_review_generate_keys import _as_begun_before
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from stage1_generate import openai_backend
from stage1_generate.config import EndpointConfig, SamplingConfig
from stage1_generate.local_backend import LocalBackend
from stage1_generate.penalty import PaddedRepetitionPenalty
from stage1_generate.rows import stop_token_ids
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


def test_top_k_and_penalty_are_asked_of_the_server(tiny_qwen3: Path) -> None:
    sampling = SamplingConfig(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)
    with OpenAIServer(tiny_qwen3, served_name="tiny") as server:
        endpoint = EndpointConfig(url=server.url, model="tiny")
        backend = openai_backend.OpenAIBackend(endpoint, sampling, [0], "unused")
        backend.generate([[5, 6, 7]], 2)
    (request,) = server.requests
    assert (request["temperature"], request["top_p"], request["top_k"]) == (0.6, 0.95, 20)
    assert request["repetition_penalty"] == 1.05


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("sampling.top_k=-2", r"top_k must be >= 0 \(0: every token\), got -2"),
        ("sampling.repetition_penalty=0", r"repetition_penalty must be > 0 \(1: none\), got 0"),
    ],
)
def test_out_of_range_is_refused(tiny_qwen3: Path, tmp_path: Path, key: str, message: str) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows())
    with pytest.raises(ValueError, match=message):
        config(tiny_qwen3, data, tmp_path / "out", key)


def test_padded_penalty_is_transformers_penalty_on_each_unpadded_row() -> None:
    torch.manual_seed(8)
    rows = [[4, 9, 4, 2], [7], [0, 0, 5]]  # 0 as a real token and as the padding
    width = max(map(len, rows)) + 2  # two generated columns after the prompts
    ids_BX = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids_BX[b, width - 2 - len(row) :] = torch.tensor([*row, 3 + b, 6])
    pads_B = torch.tensor([width - 2 - len(row) for row in rows])
    scores_BV = torch.randn(len(rows), 12) * 3
    got_BV = PaddedRepetitionPenalty(1.4, pads_B)(ids_BX, scores_BV.clone())
    for b in range(len(rows)):
        alone_1X = ids_BX[b : b + 1, pads_B[b] :]
        expected_1V = RepetitionPenaltyLogitsProcessor(1.4)(alone_1X, scores_BV[b : b + 1].clone())
        torch.testing.assert_close(got_BV[b], expected_1V[0], rtol=0, atol=0)
    assert got_BV[1, 0] == scores_BV[1, 0]  # row 1's padding 0 is not penalized


def test_greedy_rows_follow_the_penalty(tiny_qwen3: Path) -> None:
    """A batch of prompts of different lengths (left padded together) writes, row by row, the
    argmax after transformers' penalty on that row alone, one token at a time without a cache;
    and not the plain argmax."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    stops = stop_token_ids(tokenizer, None, {})
    prompts = [[5, 17, 9, 23, 5, 17], [40, 41, 40, 41], [7] * 9, [tokenizer.pad_token_id or 0, 8]]
    sampling = SamplingConfig(repetition_penalty=1.3)
    backend = LocalBackend(model, tokenizer, sampling, stops, 4, 1 << 20, "dynamic")
    got = [c.token_ids for c in backend.generate(prompts, 10)]

    def reference(prompt: list[int], penalty: float) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                logits_1V = model(torch.tensor([ids])).logits[:, -1]
                if penalty != 1:
                    logits_1V = RepetitionPenaltyLogitsProcessor(penalty)(
                        torch.tensor([ids]), logits_1V
                    )
                token = int(logits_1V.argmax())
                if token in stops:
                    break
                ids.append(token)
        return ids[len(prompt) :]

    assert got == [reference(p, 1.3) for p in prompts]
    assert got != [reference(p, 1.0) for p in prompts]


def test_a_resume_keeps_the_penalty(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The penalty decides greedy rows: another one is refused on a resume; a folder begun
    before the key existed (none named) resumes at 1, the default, with its same rows."""
    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows())
    out = tmp_path / "out"
    run_generate(config(tiny_qwen3, data, out, "sampling.repetition_penalty=1.2"))
    with pytest.raises(ValueError, match=r"sampling\.repetition_penalty: 1\.2 -> 1\.3"):
        run_generate(config(tiny_qwen3, data, out, "sampling.repetition_penalty=1.3"))
    plain = tmp_path / "plain"
    run_generate(config(tiny_qwen3, data, plain))
    before = digests(plain)
    _as_begun_before(plain, {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 6, "seed": 0})
    assert run_generate(config(tiny_qwen3, data, plain))["complete"]
    assert digests(plain) == before


def test_inspect_says_how_a_folder_sampled() -> None:
    from common.inspect_store import _generation_rows

    def how(sampling: dict) -> str:
        content = {"target": {"model": "t"}, "sampling": {"max_new_tokens": 8, **sampling}}
        return _generation_rows({"content": content})[1][1]

    assert how({"temperature": 0.6, "top_p": 0.95, "top_k": 20}).startswith(
        "temperature 0.6, top-p 0.95, top-k 20,"
    )
    # a folder of every token and no penalty: top_k 0 and penalty 1 are left out of its
    # content, as before the keys existed
    assert how({"temperature": 0.6, "top_p": 0.95}).startswith("temperature 0.6, top-p 0.95,")
    assert how({"temperature": 0.0}).startswith("greedy,")
    assert how({"temperature": 0.0, "repetition_penalty": 1.05}).startswith(
        "greedy, repetition penalty 1.05,"
    )


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ([], {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}),
        (["--set", "sampling.top_k=5"], {"temperature": 0.6, "top_p": 0.95, "top_k": 5}),
    ],
)
def test_server_sampling_writes_as_the_server_samples(
    tiny_qwen3: Path, tmp_path: Path, sets: list[str], expected: dict
) -> None:
    """`dflash generate --server-sampling`: the sampling the target's generation_config.json
    sets (as vLLM serves a request that sets none), --set beside it winning."""
    import json
    import shutil

    from click.testing import CliRunner

    from common.generated import read_manifest
    from dflash_offline.cli import main

    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    served = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (target / "generation_config.json").write_text(
        json.dumps({**served, "repetition_penalty": 1.05, "eos_token_id": 2})
    )
    data = write_jsonl(tmp_path / "rows.jsonl", chat_rows()[:2])
    out = tmp_path / "out"
    args = ["generate", "--target", str(target), "--data", str(data), "--out", str(out)]
    args += ["--devices", "cpu", "--set", "sampling.max_new_tokens=4", "--server-sampling"]
    result = CliRunner().invoke(main, [*args, *sets])
    assert result.exit_code == 0, result.output
    sampling = read_manifest(out)["content"]["sampling"]
    assert {key: sampling[key] for key in expected} == expected
