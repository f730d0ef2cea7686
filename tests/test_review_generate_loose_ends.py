"""`dflash generate`'s loose ends (review): a reply cut at the token limit inside a character
is kept to whole characters, so the stored text tokenizes back to a prefix of the target's
tokens (local backend, and a server that returns the reply's ids or its text alone); a run
refused for its inputs leaves nothing in --out, and one that failed before committing a chunk
does not hold a rerun to its settings; the totals count chat replies ended by another stop than
the end of turn; a resume whose target stops at other ids is refused; a hub target's generation
config that could not be read offline is a warning naming what was assumed."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from common.generated import read_manifest
from dflash_offline.cli import main as cli
from stage1_generate import run as generate_run
from stage1_generate.run import run_generate
from tests.log_capture import dflash_messages
from tests.openai_server import OpenAIServer
from tests.test_generate import chat_rows, config, read_rows, write_jsonl
from tests.test_generate_reply_specials import DOC, data, ids, scripted_target

# the scripted reply: a 4-byte character whose bytes are 4 tokens, then more text
CUT_SCRIPT = " ok \U0001f600 fine"


@pytest.fixture(scope="module")
def cut_target(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted_target(tiny_qwen3, CUT_SCRIPT, tmp_path_factory.mktemp("cut-target"))


def _reply(shape: str, row: dict) -> str:
    if shape == "chat":
        return row["messages"][1]["content"]
    return row["completion"] if "completion" in row else row["text"][len(DOC) :]


@pytest.mark.parametrize("backend", ["local", "ids", "no_ids"])
@pytest.mark.parametrize("shape", ["chat", "text", "completion"])
def test_a_reply_cut_inside_a_character_keeps_whole_characters(
    cut_target: Path, tmp_path: Path, shape: str, backend: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(cut_target)
    script = ids(tokenizer, CUT_SCRIPT)
    emoji = script.index(ids(tokenizer, " ok ")[-1]) + 1  # the emoji's first byte token
    assert tokenizer.decode(script[emoji : emoji + 4]) == "\U0001f600"
    limit = emoji + 2  # cut after two of its four bytes
    extra = [f"sampling.max_new_tokens={limit}", f"text.new_tokens={limit}", "run.batch_size=1"]
    out = tmp_path / "out"
    if backend == "local":
        manifest = run_generate(config(cut_target, data(tmp_path, shape), out, *extra))
    else:
        with OpenAIServer(cut_target, return_ids=backend == "ids") as server:
            remote = [f"endpoint.url={server.url}", "run.backend=openai"]
            manifest = run_generate(config(cut_target, data(tmp_path, shape), out, *extra, *remote))
    assert manifest["counts"]["truncated"] >= 1
    rows = read_rows(out)
    assert rows
    for row in rows:
        reply = _reply(shape, row)
        assert reply == " ok "  # the cut character's bytes are left out, not a U+FFFD
        assert ids(tokenizer, reply) == script[:emoji]  # a prefix of what the target wrote
        if "new_tokens" in row:  # the tokens the target wrote, with every backend
            assert row["new_tokens"] == limit


def test_a_servers_text_without_the_cut_bytes_keeps_its_ids_to_it(cut_target: Path) -> None:
    """vLLM's text leaves a cut character's bytes out while its ids hold them: the ids go (the
    text rows decode them), the text stays; a reply that ended at a stop id is kept whole."""
    from stage1_generate.local_backend import Completion
    from stage1_generate.rows import whole_characters

    tokenizer = AutoTokenizer.from_pretrained(cut_target)
    script = ids(tokenizer, CUT_SCRIPT)
    emoji = script.index(ids(tokenizer, " ok ")[-1]) + 1
    cut = script[: emoji + 3]
    vllm = whole_characters(tokenizer, Completion(" ok ", len(cut), False, cut))
    assert (vllm.text, vllm.token_ids, vllm.num_tokens) == (" ok ", script[:emoji], len(cut))
    ended = Completion(tokenizer.decode(cut), len(cut), True, cut, stop_id=0)
    assert whole_characters(tokenizer, ended) is ended


def test_a_run_refused_for_its_inputs_leaves_no_folder(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A wrong --model or --data is refused before --out is made: no empty folder holding a lock
    file is left for the user to wonder about."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    for model, source in ((tmp_path / "no-model", data), (tiny_qwen3, tmp_path / "none.jsonl")):
        args = ["generate", "--model", str(model), "--data", str(source), "--devices", "cpu"]
        result = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out")])
        assert result.exit_code != 0, result.output
        assert not (tmp_path / "out").exists()


def test_a_run_that_failed_before_any_chunk_does_not_bind_the_rerun(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first run that failed in its first chunk committed nothing: a rerun with other settings
    (the fix of what failed) starts afresh, and a chunk's rows written but never committed by
    it (a kill between the rows and their counts) are not left for extract to read."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    out = tmp_path / "out"

    def crash(*args: object) -> None:
        raise RuntimeError("CUDA out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(generate_run, "_make_backend", crash)
        with pytest.raises(RuntimeError, match="out of memory"):
            run_generate(config(tiny_qwen3, data, out))
    assert read_manifest(out)["complete"] is False
    (out / "part-000002.jsonl.gz").write_bytes(b"rows of a chunk never committed")
    manifest = run_generate(config(tiny_qwen3, data, out, "data.max_samples=2"))
    assert manifest["complete"] and manifest["num_chunks"] == 1
    assert manifest["content"]["data"]["max_samples"] == 2
    assert [p.name for p in out.glob("part-*")] == ["part-000000.jsonl.gz"]
    assert [r["source_index"] for r in read_rows(out)] == [0, 1]


def test_totals_count_chat_replies_ended_by_another_stop(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A target whose generation config ends replies at `<|endoftext|>` too, which writes it
    where the template closes a turn with `<|im_end|>`: every chat reply is recorded as not
    ended by the end of turn, and the totals say why (not cut: another stop), in the manifest
    and the summary; a folder whose chunks were counted by a version before (no such count)
    gets the total from its rows."""
    import json

    from transformers import GenerationConfig

    target = scripted_target(tiny_qwen3, " ok<|endoftext|>", tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(eos_token_id=stops).save_pretrained(target)
    out = tmp_path / "out"
    cfg = config(target, data(tmp_path, "chat"), out, "sampling.max_new_tokens=8")
    with dflash_messages() as messages:
        counts = run_generate(cfg)["counts"]
    rows = read_rows(out)
    assert [r["wrote_end_of_turn"] for r in rows] == [[False], [False, False]]
    assert counts["truncated"] == 0 and counts["other_stops"] == 3
    assert "3 ended by another stop than the end of turn" in messages[-1]
    for path in (out / ".dflash-generate").glob("chunk-*.json"):  # as a version before wrote
        stats = json.loads(path.read_text())
        del stats["other_stops"]
        path.write_text(json.dumps(stats))
    assert run_generate(cfg)["counts"]["other_stops"] == 3


def test_a_resume_whose_target_stops_elsewhere_is_refused(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The target's generation_config.json (its end of sequence: the ids replies stop at) is not
    in the key: a resume after it changed would mix chunks that stop at other ids, so it is
    refused naming the ids; a folder begun before stop_ids was recorded resumes, and windows
    written past the end of text (which no stop id ends) resume too."""
    import json
    import shutil

    from transformers import GenerationConfig

    from common.generated import manifest_path

    target = Path(shutil.copytree(tiny_qwen3, tmp_path / "target"))
    tokenizer = AutoTokenizer.from_pretrained(target)
    chat, text = data(tmp_path, "chat"), data(tmp_path, "text")
    past = "text.stop_at_eos=false"
    run_generate(config(target, chat, tmp_path / "chat"))
    run_generate(config(target, text, tmp_path / "past", past))
    run_generate(config(target, chat, tmp_path / "old"))
    old = read_manifest(tmp_path / "old")
    del old["stop_ids"]
    manifest_path(tmp_path / "old").write_text(json.dumps(old))

    own = GenerationConfig.from_pretrained(target)
    own.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|mask|>")]
    own.save_pretrained(target)
    with pytest.raises(ValueError, match=r"stop ids \[\d+\].*\[\d+, \d+\].*generation_config"):
        run_generate(config(target, chat, tmp_path / "chat"))
    assert run_generate(config(target, text, tmp_path / "past", past))["complete"]
    assert "stop_ids" not in run_generate(config(target, chat, tmp_path / "old"))


def test_a_hub_targets_generation_config_not_cached_offline_is_a_warning(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, a hub target whose cache holds its config but not its generation_config.json:
    the stop ids assumed without it are named in a warning (its own eos could be missing); a
    cache that records the file as absent on the hub, and a local folder without one, are
    quiet (transformers reads them the same way)."""
    import shutil

    from huggingface_hub import constants

    from stage1_extract.config import TargetConfig
    from stage1_generate.rows import generation_eos

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_qwen3, snapshot)
    (snapshot / "generation_config.json").unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    with dflash_messages() as messages:
        generation_eos(TargetConfig(model="org/tiny"))
    assert len(messages) == 1
    assert "org/tiny" in messages[0] and "not in the local hub cache" in messages[0]
    assert "assuming it has none" in messages[0] and "hf download org/tiny" in messages[0]

    (repo / ".no_exist" / ("a" * 40)).mkdir(parents=True)
    (repo / ".no_exist" / ("a" * 40) / "generation_config.json").touch()
    with dflash_messages() as messages:
        generation_eos(TargetConfig(model="org/tiny"))
        generation_eos(TargetConfig(model=str(snapshot)))
    assert messages == []
