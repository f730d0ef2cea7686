"""`dflash generate --endpoint`: the stop ids sent to the server (`stop_token_ids`) left out the
target's generation config's end of sequence (Qwen3's `<|endoftext|>` beside `<|im_end|>`),
which the local backend stops at and the manifest records in `stop_ids`. vLLM adds it itself;
another server (tests/openai_server.py stops at what it is sent, else the tokenizer's end of
sequence) wrote past it, so rows differed from the local backend's and ran on where the
target had ended its reply. Now the manifest's `stop_ids` are sent.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_generate import read_rows, write_jsonl
from test_review_stop_ids import extra_eos_target
from transformers import AutoTokenizer

from common.config import build_config
from common.generated import read_manifest
from stage1_generate.config import GenerateConfig
from stage1_generate.run import run_generate
from tests.openai_server import OpenAIServer
from tests.test_chained import PROMPTS

__all__ = ["extra_eos_target"]  # the fixture, shared


def _generate(model: Path, data: Path, out: Path, url: str | None = None) -> dict:
    flags = [f"target.model={model}", "target.dtype=float32", f"data.path={data}"]
    flags += [f"output.out={out}", "output.rows_per_chunk=2", "run.devices=cpu"]
    flags += ["run.batch_size=1", "run.progress=false", "sampling.max_new_tokens=24"]
    if url is not None:
        flags += [f"endpoint.url={url}", "run.backend=openai", "endpoint.concurrency=2"]
    return run_generate(build_config(GenerateConfig, None, "generate", flags))


def test_the_server_is_sent_the_stop_ids_the_local_backend_stops_at(
    extra_eos_target: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "completion": "x"} for p in PROMPTS])
    local = _generate(extra_eos_target, data, tmp_path / "local")
    with OpenAIServer(extra_eos_target) as server:
        remote = _generate(extra_eos_target, data, tmp_path / "remote", server.url)
    stop_ids = read_manifest(tmp_path / "remote")["stop_ids"]
    config = json.loads((extra_eos_target / "generation_config.json").read_text())
    assert set(config["eos_token_id"]) <= set(stop_ids) and stop_ids == local["stop_ids"]
    assert [r["stop_token_ids"] for r in server.requests] == [stop_ids] * len(PROMPTS)
    # the replies the generation config's extra id ends (extra_eos_target: two or more) end
    # there, as the local backend's (before: they ran on to the token limit), and the totals
    # agree. Which stop token ends a row's text aside: the test server returns the first stop
    # id for any (vLLM returns the one met)
    stops = AutoTokenizer.from_pretrained(extra_eos_target).convert_ids_to_tokens(stop_ids)

    def reply(row: dict) -> tuple[str, int]:
        text = row["completion"]
        return next((text[: -len(s)] for s in stops if text.endswith(s)), text), row["new_tokens"]

    remote_rows, local_rows = read_rows(tmp_path / "remote"), read_rows(tmp_path / "local")
    assert [reply(r) for r in remote_rows] == [reply(r) for r in local_rows]
    assert remote["counts"] == local["counts"]
