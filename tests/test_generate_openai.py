"""`dflash generate --endpoint`: the OpenAI-compatible backend against a small in-process server.

The server (tests/openai_server.py) replies with the local backend on the tiny target, one
prompt at a time, so the reference is the local backend with `run.batch_size=1`.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from common.config import build_config
from common.generated import read_manifest
from stage1_generate import openai_backend
from stage1_generate.config import GenerateConfig
from stage1_generate.run import run_generate
from tests.openai_server import OpenAIServer

CHAT = [
    [{"role": "user", "content": "What is a prime number?"}, {"role": "assistant", "content": "x"}],
    [
        {"role": "system", "content": "You are concise."},
        {"role": "user", "content": "Boil an egg?"},
        {"role": "assistant", "content": "Six minutes."},
        {"role": "user", "content": "And a hard yolk?"},
        {"role": "assistant", "content": "Ten."},
    ],
    [
        {"role": "user", "content": "Say good morning in French."},
        {"role": "assistant", "content": "Bonjour."},
    ],
]
TEXT = [
    "A prime number is a whole number greater than one whose only divisors are one and itself. "
    "Two, three, five and seven are the first primes, and there are infinitely many of them.",
    "Put the request in the first sentence and keep one topic per email.",
]

# text on which tiny_eos_target writes ends of text
FOX = "the quick brown fox jumps over the lazy dog " * 6


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def chat_data(tmp_path: Path) -> Path:
    return _write(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT])


@pytest.fixture
def text_data(tmp_path: Path) -> Path:
    return _write(tmp_path / "text.jsonl", [{"text": t} for t in TEXT])


def _overrides(model: Path, data: Path, out: Path) -> list[str]:
    return [
        f"target.model={model}",
        "target.dtype=float32",
        f"data.path={data}",
        f"output.out={out}",
        "output.rows_per_chunk=1",
        "run.devices=cpu",
        "run.batch_size=1",
        "run.progress=false",
        "sampling.max_new_tokens=8",
        "text.prompt_tokens=12",
        "text.new_tokens=6",
        "text.stride=20",
    ]


def _generate(model: Path, data: Path, out: Path, url: str | None = None, *extra: str) -> Any:
    overrides = _overrides(model, data, out)
    if url is not None:
        overrides += [f"endpoint.url={url}", "run.backend=openai", "endpoint.concurrency=4"]
    return run_generate(build_config(GenerateConfig, None, "generate", [*overrides, *extra]))


def _rows(out: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for part in sorted(out.glob("part-*.jsonl.gz"))
        for line in gzip.decompress(part.read_bytes()).decode().splitlines()
    ]


@pytest.mark.parametrize("shape,return_ids", [("chat", False), ("text", True), ("text", False)])
def test_openai_backend_equals_local_greedy(
    tiny_qwen3: Path, chat_data: Path, text_data: Path, tmp_path: Path, shape: str, return_ids: bool
) -> None:
    data = chat_data if shape == "chat" else text_data
    local = _generate(tiny_qwen3, data, tmp_path / "local")
    with OpenAIServer(tiny_qwen3, return_ids=return_ids) as server:
        remote = _generate(tiny_qwen3, data, tmp_path / "remote", server.url)
    rows = _rows(tmp_path / "remote")
    assert rows == _rows(tmp_path / "local")
    assert remote["complete"] and remote["counts"] == local["counts"]
    assert remote["backend"] == {"kind": "openai", "endpoint": server.url}
    if shape == "chat":  # user turns verbatim, every assistant turn the target's
        assert len(rows) == len(CHAT) and rows[1]["messages"][3] == CHAT[1][3]
        assert rows[1]["generated_turns"] == 2
    assert remote["counts"]["new_tokens"] > 0


@pytest.mark.parametrize("return_ids", [True, False])
def test_text_past_the_end_of_text_equals_local(
    tiny_eos_target: Path, tmp_path: Path, return_ids: bool
) -> None:
    """text.stop_at_eos=false through a server: it is asked to ignore the end of sequence and
    to write special tokens (with or without the reply's ids): the local backend's rows."""
    text_data = _write(tmp_path / "fox.jsonl", [{"text": FOX}])
    past = ("text.stop_at_eos=false", "text.new_tokens=16")
    local = _generate(tiny_eos_target, text_data, tmp_path / "local", None, *past)
    with OpenAIServer(tiny_eos_target, return_ids=return_ids) as server:
        remote = _generate(tiny_eos_target, text_data, tmp_path / "remote", server.url, *past)
    rows = _rows(tmp_path / "remote")
    assert rows == _rows(tmp_path / "local") and remote["counts"] == local["counts"]
    eos = server.tokenizer.eos_token
    assert any(eos in r["text"] for r in rows), "no reply wrote an end of text"
    assert all(r["ignore_eos"] and not r["skip_special_tokens"] for r in server.requests)
    assert all(r["stop_token_ids"] == [] for r in server.requests)


@pytest.mark.parametrize("return_ids", [True, False])
def test_text_with_special_tokens_equals_local(
    tiny_qwen3: Path, tmp_path: Path, return_ids: bool
) -> None:
    """A document holding special tokens (an end of text between documents, a chat marker):
    through a server the rows' prompts keep them as text, as the local backend's."""
    text = "the quick brown fox<|endoftext|>jumps over<|im_start|> the lazy dog " * 4
    data = _write(tmp_path / "special.jsonl", [{"text": text}])
    split = "text.loss_on_prompt=false"
    local = _generate(tiny_qwen3, data, tmp_path / "local", None, split)
    with OpenAIServer(tiny_qwen3, return_ids=return_ids) as server:
        remote = _generate(tiny_qwen3, data, tmp_path / "remote", server.url, split)
    rows = _rows(tmp_path / "remote")
    assert rows == _rows(tmp_path / "local") and remote["counts"] == local["counts"]
    assert any("<|endoftext|>" in r["prompt"] for r in rows)
    assert not any(r["skip_special_tokens"] for r in server.requests)


def test_a_server_that_stops_at_the_end_of_text_anyway_is_named(
    tiny_eos_target: Path, tmp_path: Path
) -> None:
    """A server that does not honour ignore_eos would cut the rows short: refused by name."""
    text_data = _write(tmp_path / "fox.jsonl", [{"text": FOX}])
    server = OpenAIServer(tiny_eos_target, ignores_eos=False)
    past = ("text.stop_at_eos=false", "text.new_tokens=16")
    with server, pytest.raises(ValueError, match="ignore_eos.*text.stop_at_eos=true"):
        _generate(tiny_eos_target, text_data, tmp_path / "out", server.url, *past)


def test_failure_mid_run_then_rerun_resumes(
    tiny_qwen3: Path, chat_data: Path, tmp_path: Path
) -> None:
    with OpenAIServer(tiny_qwen3) as server:
        _generate(tiny_qwen3, chat_data, tmp_path / "whole", server.url)
    out = tmp_path / "out"
    # request 1: chunk 0's one reply; 2 and 3: chunk 1's two turns, the second fails
    failing = OpenAIServer(tiny_qwen3, fail=lambda n: n > 2)
    with failing, pytest.raises(ValueError, match="failed 1 time.*HTTP 500: injected failure"):
        _generate(tiny_qwen3, chat_data, out, failing.url, "endpoint.max_retries=0")
    assert sorted(p.name for p in out.glob("part-*")) == ["part-000000.jsonl.gz"]
    assert not read_manifest(out)["complete"]
    with OpenAIServer(tiny_qwen3) as server:  # a new server on another port: still resumes
        final = _generate(tiny_qwen3, chat_data, out, server.url)
        assert server.num_completions == 3  # chunks 1 (two turns) and 2 only
    assert final["complete"] and _rows(out) == _rows(tmp_path / "whole")


def test_transient_500_is_retried(
    tiny_qwen3: Path, text_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_backend, "BACKOFF_S", 0.0)
    _generate(tiny_qwen3, text_data, tmp_path / "local")
    with OpenAIServer(tiny_qwen3, fail=lambda n: n in (2, 3)) as server:
        final = _generate(tiny_qwen3, text_data, tmp_path / "out", server.url)
        assert server.num_completions == final["counts"]["prompts"] + 2
    assert final["complete"] and _rows(tmp_path / "out") == _rows(tmp_path / "local")


def test_unreachable_endpoint_fails_fast_and_keeps_chunks(
    tiny_qwen3: Path, chat_data: Path, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from dflash_offline.cli import main

    out = tmp_path / "out"
    with OpenAIServer(tiny_qwen3, fail=lambda n: n > 2) as server:
        url = server.url
        with pytest.raises(ValueError):
            _generate(tiny_qwen3, chat_data, out, url, "endpoint.max_retries=0")
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert "part-000000.jsonl.gz" in before
    args = ["generate", "--model", str(tiny_qwen3), "--data", str(chat_data), "--out", str(out)]
    sets = [a for o in _overrides(tiny_qwen3, chat_data, out)[1:] for a in ("--set", o)]
    result = CliRunner().invoke(main, [*args, "--endpoint", url, *sets])
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"error: endpoint {url} is unreachable"), message
    assert "start the server" in message and "--endpoint" in message
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_server_errors_are_named(tiny_qwen3: Path, chat_data: Path, tmp_path: Path) -> None:
    with OpenAIServer(tiny_qwen3, served_name="tiny-target", max_model_len=10) as server:
        with pytest.raises(ValueError, match=r"serves \['tiny-target'\], not '.*tiny-qwen3"):
            _generate(tiny_qwen3, chat_data, tmp_path / "a", server.url)
        # a 4xx is not retried: it names the status and the server's message
        with pytest.raises(ValueError, match="HTTP 400: This model's maximum context length is 10"):
            _generate(
                tiny_qwen3, chat_data, tmp_path / "b", server.url, "endpoint.model=tiny-target"
            )
        assert server.num_completions == 1


def test_a_row_past_the_servers_context_is_too_long(
    tiny_qwen3: Path, chat_data: Path, tmp_path: Path
) -> None:
    """A server whose model card gives max_model_len (vLLM's does): a row past it is an invalid
    row, skipped and counted under data.on_invalid=skip, as with the local backend, instead of
    an HTTP 400 that stops the run at the same chunk on every rerun."""
    with OpenAIServer(tiny_qwen3, "tiny-target", max_model_len=40, advertise_len=True) as server:
        manifest = _generate(
            tiny_qwen3,
            chat_data,
            tmp_path / "out",
            server.url,
            "endpoint.model=tiny-target",
            "data.on_invalid=skip",
        )
        # every request sent fitted the context: no 400 was answered
        assert all(len(r["prompt"]) + r["max_tokens"] <= 40 for r in server.requests)
    skipped = manifest["counts"]["skipped"]
    assert manifest["complete"] and skipped.get("too_long", 0) >= 1, skipped
    assert len(_rows(tmp_path / "out")) == len(CHAT) - skipped["too_long"]


def test_requests_leave_no_sampling_default_to_the_server(tiny_qwen3: Path) -> None:
    """vLLM fills what a request leaves out from the target's generation_config.json (a
    repetition penalty, top_k, min_p): each request sets them to what changes nothing."""
    from stage1_generate.config import EndpointConfig, SamplingConfig

    with OpenAIServer(tiny_qwen3, served_name="tiny") as server:
        endpoint = EndpointConfig(url=server.url, model="tiny")
        openai_backend.OpenAIBackend(endpoint, SamplingConfig(), [0], "unused").generate(
            [[5, 6, 7]], 2
        )
    (request,) = server.requests
    assert request["repetition_penalty"] == 1.0 and request["top_k"] == -1
    assert request["min_p"] == 0.0 and request["temperature"] == 0.0


@pytest.mark.parametrize("return_ids", [True, False])
def test_reply_ending_at_a_stop_id(tiny_qwen3: Path, return_ids: bool) -> None:
    """The server counts the stop token, the local backend does not: the backend agrees with
    the local one on a reply that ends at a stop id."""
    from stage1_generate.config import EndpointConfig, SamplingConfig
    from stage1_generate.local_backend import LocalBackend

    prompts = [[5, 6, 7, 8], [9, 10]]
    with OpenAIServer(tiny_qwen3, served_name="tiny", return_ids=return_ids) as server:
        local = LocalBackend(server.model, server.tokenizer, SamplingConfig(), [0], 1, 1 << 20)
        stop = local.generate(prompts[:1], 6)[0].token_ids[2]  # greedy's third token: a stop
        local.stop_ids = [stop]
        expected = local.generate(prompts, 6)
        endpoint = EndpointConfig(url=server.url, model="tiny")
        remote = openai_backend.OpenAIBackend(endpoint, SamplingConfig(), [stop], "unused")
        progress: list[tuple[int, int]] = []
        got = remote.generate(prompts, 6, lambda n, t: progress.append((n, t)))
    assert expected[0].finished and expected[0].num_tokens == 2
    for e, g in zip(expected, got, strict=True):
        assert (g.text, g.num_tokens, g.finished) == (e.text, e.num_tokens, e.finished)
        assert g.token_ids == (e.token_ids if return_ids else None)
    assert sorted(progress) == sorted((1, e.num_tokens) for e in expected)
