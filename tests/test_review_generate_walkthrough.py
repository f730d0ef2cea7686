"""`dflash generate`, walked through as a careful user would: what it writes, what extract reads
back, and how it resumes and refuses.

The stop token: a text or completion row whose reply the target ended holds that stop token's
text, so extract stores it with loss on it (no chat template writes an end after such a reply:
before, the drafter never learned to predict the stop where the target writes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.config import build_config
from common.generated import manifest_path, read_manifest
from stage1_extract.store_root import content_key
from stage1_generate.config import GenerateConfig
from stage1_generate.inputs import REPLY_SPECIALS, REPLY_STOP
from stage1_generate.openai_backend import OpenAIBackend
from stage1_generate.run import run_generate
from tests.openai_server import OpenAIServer
from tests.test_generate import config, read_rows, write_jsonl
from tests.test_generate_reply_specials import (
    DOC,
    LENGTHS,
    SCRIPT,
    data,
    extracted,
    ids,
    scripted,  # noqa: F401 (the fixture)
)


@pytest.mark.parametrize(
    "shape,extra",
    [("text", ()), ("text", ("text.loss_on_prompt=false",)), ("completion", ())],
    ids=["text", "text_split", "completion"],
)
@pytest.mark.parametrize("backend", ["local", "openai_ids", "openai_no_ids"])
def test_a_reply_the_target_ended_keeps_its_stop_token(
    scripted: Path,  # noqa: F811
    tmp_path: Path,
    shape: str,
    extra: tuple[str, ...],
    backend: str,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    script, end = ids(tokenizer, SCRIPT), tokenizer.convert_tokens_to_ids("<|im_end|>")
    source, out = data(tmp_path, shape), tmp_path / "out"
    settings = [*LENGTHS, *extra, "run.batch_size=1"]
    if backend == "local":
        manifest = run_generate(config(scripted, source, out, *settings))
    else:
        with OpenAIServer(scripted, return_ids=backend == "openai_ids") as server:
            remote = [f"endpoint.url={server.url}", "run.backend=openai"]
            manifest = run_generate(config(scripted, source, out, *settings, *remote))
    assert manifest["counts"]["truncated"] == 0
    assert manifest["content"][REPLY_STOP] == "written"
    (row,) = read_rows(out)
    split = "completion" in row
    assert (row["completion"] if split else row["text"][len(DOC) :]) == SCRIPT + "<|im_end|>"
    assert row["new_tokens"] == len(script)  # the reply's own tokens, as before
    ((input_ids, mask),) = extracted(scripted, out, tmp_path)
    assert input_ids == ids(tokenizer, DOC) + script + [end]
    assert mask[-1] == 1 and sum(mask) == (len(script) + 1 if split else len(input_ids))


def test_a_reply_cut_at_the_limit_and_chat_rows_get_no_stop(
    scripted: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A window cut at text.new_tokens ends where it was cut; a chat turn's end is the
    template's (once), and chat outputs keep their key."""
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    script = ids(tokenizer, SCRIPT)
    short = f"text.new_tokens={len(script) - 1}"
    manifest = run_generate(config(scripted, data(tmp_path, "text"), tmp_path / "cut", short))
    assert manifest["counts"]["truncated"] == 1
    ((input_ids, _),) = extracted(scripted, tmp_path / "cut", tmp_path)
    assert input_ids == ids(tokenizer, DOC) + script[:-1]
    chat = run_generate(config(scripted, data(tmp_path, "chat"), tmp_path / "chat", *LENGTHS))
    assert REPLY_STOP not in chat["content"]
    replies = [m["content"] for r in read_rows(tmp_path / "chat") for m in r["messages"]][1::2]
    assert replies[0] == SCRIPT  # no <|im_end|> of its own: the template writes it
    past = config(scripted, data(tmp_path, "text"), tmp_path / "past", "text.stop_at_eos=false")
    assert REPLY_STOP not in run_generate(past)["content"]  # nothing stops: the key is as before


def _as_version_before(out: Path, marker: str, complete: bool) -> None:
    manifest = read_manifest(out)
    manifest["content"].pop(marker)
    manifest.update(key=content_key(manifest["content"]), complete=complete)
    manifest_path(out).write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("marker", [REPLY_STOP, REPLY_SPECIALS])
def test_a_folder_of_a_version_without_the_stop_is_kept_or_refused(
    scripted: Path,  # noqa: F811
    tmp_path: Path,
    marker: str,
) -> None:
    """A finished folder written before the stop was kept reruns as a no-op (extract reads it
    as it was: no stop); an unfinished one is refused, naming what it left out (its chunks and
    this version's would mix)."""
    source = write_jsonl(tmp_path / "text.jsonl", [{"text": DOC}, {"text": "import os"}])
    out = tmp_path / "out"
    cfg = config(scripted, source, out, *LENGTHS)
    run_generate(cfg)
    before = read_rows(out)
    _as_version_before(out, REPLY_STOP, complete=True)
    if marker == REPLY_SPECIALS:  # older still: neither marker
        _as_version_before(out, REPLY_SPECIALS, complete=True)
    again = run_generate(cfg)
    assert REPLY_STOP not in again["content"] and read_rows(out) == before
    manifest = read_manifest(out)
    manifest["complete"] = False
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    (out / ".dflash-generate" / "chunk-000001.json").unlink()
    with pytest.raises(ValueError, match=r"older dflash-offline.*stop token.*--overwrite") as err:
        run_generate(cfg)
    assert ("python_tag" in str(err.value)) == (marker == REPLY_SPECIALS)
    overwrite = config(scripted, source, out, *LENGTHS, "output.overwrite=true")
    assert run_generate(overwrite)["content"][REPLY_STOP] == "written"
    assert read_rows(out) == before


def _backend(stop_ids: list[int], eos_id: int | None) -> OpenAIBackend:
    backend = OpenAIBackend.__new__(OpenAIBackend)  # no server: _parse alone
    backend.url, backend.stop_ids, backend.eos_id = "http://x/v1", stop_ids, eos_id
    return backend


@pytest.mark.parametrize(
    "choice,expected",
    [
        ({"token_ids": [5, 7, 3]}, 3),  # the ids say it (vLLM with return_token_ids)
        ({"matched_stop": 3}, 3),  # SGLang
        ({"stop_reason": 3}, 3),  # vLLM: a stop_token_ids entry
        ({"stop_reason": None}, 2),  # vLLM: its own end of sequence, the tokenizer's
        ({}, None),  # nothing says which of two
    ],
)
def test_the_openai_backend_finds_the_stop_id(choice: dict, expected: int | None) -> None:
    answer = {"choices": [{"text": "ab", "finish_reason": "stop", **choice}]}
    answer["usage"] = {"completion_tokens": 3}
    completion = _backend([2, 3], eos_id=2)._parse(json.dumps(answer).encode())
    assert completion.stop_id == expected and completion.num_tokens == 2
    one = _backend([3], eos_id=None)._parse(json.dumps(answer).encode())
    assert one.stop_id == 3  # a single stop id: that one
    cut = dict(answer, choices=[{"text": "ab", "finish_reason": "length"}])
    assert _backend([2, 3], eos_id=2)._parse(json.dumps(cut).encode()).stop_id is None


@pytest.mark.parametrize("timeout", ["0", "-1", ".nan"])
def test_a_request_timeout_that_is_not_positive_is_refused_by_name(timeout: str) -> None:
    """endpoint.timeout_s 0 made every request's socket non-blocking (BlockingIOError, retried
    and reported as an overloaded server); -1 failed as "Timeout value out of range", naming no
    setting; both after the manifest was written (the /models check has its own timeout)."""
    flags = ["target.model=m", "data.path=d", "output.out=o", "run.backend=openai"]
    flags += ["endpoint.url=http://127.0.0.1:8000/v1", f"endpoint.timeout_s={timeout}"]
    with pytest.raises(ValueError, match=r"endpoint: timeout_s must be > 0"):
        build_config(GenerateConfig, None, "generate", flags)


@pytest.mark.parametrize("inside", ["gen", ".", "sub/gen"])
def test_an_out_inside_the_data_folder_is_refused_before_anything_is_written(
    tiny_qwen3: Path, tmp_path: Path, inside: str
) -> None:
    """The data folder is read with its sub-folders: the first run of `--data D --out D/gen`
    went through, and its rerun (or resume after a kill) read D/gen's rows as source rows and
    failed on their columns (a `datasets` cast error about the run's own output)."""
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "text.jsonl", [{"text": DOC}])
    out = folder / inside
    with pytest.raises(ValueError, match=r"--out .* is inside --data .*pick an --out outside"):
        run_generate(config(tiny_qwen3, folder, out))
    assert not (out / ".dflash-generate").exists()
    assert not (out / ".dflash-generate.lock").exists()
    # an --out beside the data runs as before
    run_generate(config(tiny_qwen3, folder / "text.jsonl", tmp_path / "gen"))
