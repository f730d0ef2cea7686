"""`dflash generate` on a tiny target (local backend, CPU): chat rows rewritten turn by turn
through the chat template, text continuation windows, the output read back by extract with its
provenance, resume after a kill equal to an uninterrupted run, and bad inputs."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import build_config
from common.generated import read_manifest
from common.inspect_store import _generation_rows
from common.store import open_store
from dflash_offline.cli import main as cli
from stage1_extract.config import ExtractConfig
from stage1_extract.data import prepare_documents
from stage1_extract.run import run_extract
from stage1_generate import gqa_decode
from stage1_generate import run as generate_run
from stage1_generate.config import GenerateConfig, SamplingConfig
from stage1_generate.local_backend import Completion, LocalBackend
from stage1_generate.output import output_lock
from stage1_generate.rows import stop_token_ids, text_windows, whole_characters
from stage1_generate.run import run_generate

CONVERSATIONS = [
    [("user", "What is a prime number?"), ("assistant", "A number with two divisors.")],
    [
        ("system", "You are terse."),
        ("user", "Name a color."),
        ("assistant", "Blue."),
        ("user", "Another one?"),
        ("assistant", "Red."),
    ],
    [("user", "Say hi."), ("assistant", "Hi.")],
    [("user", "Count to three."), ("assistant", "One, two, three.")],
    [("user", "Best pet?"), ("assistant", "A cat."), ("user", "Why?"), ("assistant", "Calm.")],
]
TEXTS = [
    "the quick brown fox jumps over the lazy dog " * 6,
    "a short line",
    "import os\nimport sys\n\ndef main():\n    print(sys.argv)\n" * 3,
]


def chat_rows() -> list[dict]:
    return [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in CONVERSATIONS]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(model: Path, data: Path, out: Path, *extra: str) -> GenerateConfig:
    flags = [
        f"target.model={model}",
        f"data.path={data}",
        f"output.out={out}",
        "target.dtype=float32",
        "run.devices=cpu",
        "run.progress=false",
        "sampling.max_new_tokens=6",
        "text.prompt_tokens=12",
        "text.new_tokens=5",
        "text.stride=20",
        "output.rows_per_chunk=2",
    ]
    return build_config(GenerateConfig, None, "generate", [*flags, *extra])


def extract_config(model: Path, data: Path, store: Path) -> ExtractConfig:
    """debug.yaml's extract settings over a generated folder, 64-token sequences."""
    flags = [f"target.model={model}", f"data.path={data}", f"store.out={store}"]
    flags += ["run.progress=false", "packing.seq_len=64"]
    return build_config(
        ExtractConfig, Path(__file__).parents[1] / "configs" / "debug.yaml", "extract", flags
    )


def read_rows(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("part-*.jsonl.gz")):
        rows += [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
    return rows


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("part-*.jsonl.gz")
    }


def greedy_reply(
    model_dir: Path, prompt_ids: list[int], max_new: int, stop: bool = True, stored: bool = True
) -> list[int]:
    """The target's greedy continuation, one token at a time without a cache (the reference);
    `stop` false: on past the stop ids; `stored`: as a row stores it (cut at `max_new` inside a
    character: without that character's first bytes, `whole_characters`)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = set(stop_token_ids(tokenizer, None, {})) if stop else set()
    ids = list(prompt_ids)
    finished = False
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token in stops:
                finished = True
                break
            ids.append(token)
    reply = ids[len(prompt_ids) :]
    if not stored:
        return reply
    completion = Completion(tokenizer.decode(reply), len(reply), finished, reply)
    return whole_characters(tokenizer, completion).token_ids


@pytest.fixture(scope="module")
def chat_out(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gen-chat")
    data = write_jsonl(tmp / "chat.jsonl", chat_rows())
    run_generate(config(tiny_qwen3, data, tmp / "out"))
    return tmp / "out"


def test_chat_turns_rewritten_user_turns_verbatim(chat_out: Path, tiny_qwen3: Path) -> None:
    rows = read_rows(chat_out)
    assert [r["source_index"] for r in rows] == list(range(len(CONVERSATIONS)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    for row, conv in zip(rows, CONVERSATIONS, strict=True):
        messages = row["messages"]
        assert [m["role"] for m in messages] == [r for r, _ in conv]
        for message, (role, content) in zip(messages, conv, strict=True):
            if role != "assistant":
                assert message["content"] == content  # kept verbatim
        # each assistant turn is the target's greedy reply to the rewritten history before it
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(
                messages[:i], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            expected = greedy_reply(tiny_qwen3, ids, 6)
            # a special token it wrote (not the stop token) stays, as its text
            assert message["content"] == tokenizer.decode(expected, skip_special_tokens=False)
    assert sum(r["generated_turns"] for r in rows) == 7


def test_output_extracts_with_provenance(chat_out: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    debug = Path(__file__).parents[1] / "configs" / "debug.yaml"
    store = tmp_path / "store"
    result = CliRunner().invoke(
        cli,
        ["extract", "--config", str(debug), "--model", str(tiny_qwen3), "--data", str(chat_out)]
        + ["--out", str(store), "--set", "run.progress=false"],
    )
    assert result.exit_code == 0, result.output
    attrs = open_store(store).attrs
    assert attrs["dataset"]["num_rows"] == len(CONVERSATIONS)
    generation = attrs["generation"]
    manifest = read_manifest(chat_out)
    assert generation["key"] == manifest["key"] and generation["complete"]
    assert generation["content"]["sampling"]["temperature"] == 0.0
    assert generation["counts"]["rows_out"] == len(CONVERSATIONS)
    assert generation["target"]["weights_sha256"]
    shown = CliRunner().invoke(cli, ["inspect", str(store)])
    assert shown.exit_code == 0, shown.output
    assert "generated by" in shown.output and "greedy" in shown.output
    # samples name rows of the generated dataset as such (their source_index is in its files)
    sample = CliRunner().invoke(cli, ["inspect", str(store), "--sample", "1"])
    assert sample.exit_code == 0, sample.output
    assert ": generated row " in sample.output and ": source row " not in sample.output


def test_text_windows(tiny_qwen3: Path, tmp_path: Path) -> None:
    assert text_windows(list(range(50)), 12, 20) == [0, 20]
    assert text_windows(list(range(5)), 12, 20) == [0]  # shorter than a prompt: one window
    assert text_windows([], 12, 20) == []
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    as_text = run_generate(config(tiny_qwen3, data, tmp_path / "text"))
    manifest = run_generate(config(tiny_qwen3, data, tmp_path / "out", "text.loss_on_prompt=false"))
    # the default writes each window as one text row: the same windows, prompt + completion
    split = [
        (r["source_index"], r["window_start"], r["prompt"] + r["completion"])
        for r in read_rows(tmp_path / "out")
    ]
    whole = [
        (r["source_index"], r["window_start"], r["text"]) for r in read_rows(tmp_path / "text")
    ]
    assert whole == split and as_text["counts"] == manifest["counts"]
    rows = read_rows(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    expected = []
    for index, text in enumerate(TEXTS):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected += [(index, s) for s in text_windows(ids, 12, 20)]
    assert [(r["source_index"], r["window_start"]) for r in rows] == expected
    for row in rows:
        ids = tokenizer(TEXTS[row["source_index"]], add_special_tokens=False)["input_ids"]
        prompt = ids[row["window_start"] : row["window_start"] + 12]
        reply = greedy_reply(tiny_qwen3, prompt, 5)
        assert row["new_tokens"] == len(greedy_reply(tiny_qwen3, prompt, 5, stored=False))
        assert row["prompt"] == tokenizer.decode(prompt, skip_special_tokens=False)
        whole = tokenizer.decode(prompt + reply, skip_special_tokens=False)
        assert row["prompt"] + row["completion"] == whole
    assert manifest["counts"]["prompts"] == len(expected)
    assert manifest["counts"]["new_tokens"] == sum(r["new_tokens"] for r in rows)

    # extract reads {prompt, completion} rows with the loss on the completion only
    extract_cfg = extract_config(tiny_qwen3, tmp_path / "out", tmp_path / "store")
    prepared = prepare_documents(extract_cfg.data, tokenizer)
    assert prepared.format == "completion"
    for doc, row in zip(prepared.dataset, rows, strict=True):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        completion_ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        assert doc["input_ids"] == prompt_ids + completion_ids
        assert doc["loss_mask"] == [0] * len(prompt_ids) + [1] * len(completion_ids)
    run_extract(extract_cfg)
    counts = open_store(tmp_path / "store").attrs["counts"]
    assert counts["loss_tokens"] == sum(sum(d["loss_mask"]) for d in prepared.dataset)


def test_text_rows_written_past_the_end_of_text(tiny_eos_target: Path, tmp_path: Path) -> None:
    """text.stop_at_eos=false: every reply runs to text.new_tokens, past the target's end of
    text, which the row keeps as its text; extract reads that token back. The default ends each
    reply before it, and its manifest key does not name the setting (earlier outputs resume)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_eos_target)
    eos = tokenizer.eos_token_id
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    longer = "text.new_tokens=8"
    past = run_generate(
        config(tiny_eos_target, data, tmp_path / "past", longer, "text.stop_at_eos=false")
    )
    stopped = run_generate(config(tiny_eos_target, data, tmp_path / "stopped", longer))
    assert past["content"]["text"]["stop_at_eos"] is False
    assert "stop_at_eos" not in stopped["content"]["text"]
    shown = [line for manifest in (past, stopped) for _, line in _generation_rows(manifest)]
    assert sum("written past the end of text" in line for line in shown) == 1  # inspect's
    windows = []
    for index, text in enumerate(TEXTS):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in text_windows(ids, 12, 20):
            prompt = ids[start : start + 12]
            windows.append((index, start, prompt, greedy_reply(tiny_eos_target, prompt, 8, False)))
    assert any(eos in reply for *_, reply in windows), "no reply wrote an end of text"
    rows = read_rows(tmp_path / "past")
    assert [(r["source_index"], r["window_start"]) for r in rows] == [w[:2] for w in windows]
    for row, (_, _, prompt, reply) in zip(rows, windows, strict=True):
        assert row["new_tokens"] == 8
        assert row["text"] == tokenizer.decode(prompt + reply, skip_special_tokens=False)
    assert past["counts"]["truncated"] == len(windows)
    # the default: each reply ends at its first end of text, written as the row's last token
    # (a reply that is one alone leaves no row); another special token it wrote stays
    cut = [(i, s, p, r[: r.index(eos) + 1] if eos in r else r) for i, s, p, r in windows]
    expected = [
        (i, s, tokenizer.decode(p + r, skip_special_tokens=False))
        for i, s, p, r in cut
        if r and r != [eos]
    ]
    got = [
        (r["source_index"], r["window_start"], r["text"]) for r in read_rows(tmp_path / "stopped")
    ]
    assert got == expected
    # extract tokenizes the written end of text back to its id
    extract_cfg = extract_config(tiny_eos_target, tmp_path / "past", tmp_path / "store")
    prepared = prepare_documents(extract_cfg.data, tokenizer)
    for doc, (_, _, prompt, reply) in zip(prepared.dataset, windows, strict=True):
        assert doc["input_ids"].count(eos) == (prompt + reply).count(eos)
        assert doc["loss_mask"] == [1] * len(doc["input_ids"])


def test_kill_and_resume_equals_uninterrupted(
    chat_out: Path, tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    out = tmp_path / "out"
    real = generate_run.write_chunk
    calls = []

    def dies_on_second_chunk(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill between two chunks
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_run, "write_chunk", dies_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        run_generate(config(tiny_qwen3, data, out))
    assert len(digests(out)) == 1 and not read_manifest(out)["complete"]
    monkeypatch.setattr(generate_run, "write_chunk", real)
    manifest = run_generate(config(tiny_qwen3, data, out))
    assert manifest["complete"]
    assert digests(out) == digests(chat_out)  # byte-identical to the uninterrupted run
    assert read_rows(out) == read_rows(chat_out)


def test_rerun_with_other_settings_refused(chat_out: Path, tiny_qwen3: Path) -> None:
    data = Path(read_manifest(chat_out)["content"]["data"]["path"])
    with pytest.raises(ValueError, match=r"other settings.*max_new_tokens: 6 -> 7"):
        run_generate(config(tiny_qwen3, data, chat_out, "sampling.max_new_tokens=7"))


def test_bad_inputs_clear_errors_finished_chunks_kept(tiny_qwen3: Path, tmp_path: Path) -> None:
    rows = chat_rows()
    rows[3] = {"messages": [{"role": "user", "content": "no reply here"}]}  # chunk 1
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"row 3: the conversation has no assistant message.*skip"):
        run_generate(config(tiny_qwen3, data, out))
    assert [p.name for p in out.glob("part-*")] == ["part-000000.jsonl.gz"]  # chunk 0 kept
    manifest = run_generate(config(tiny_qwen3, data, out, "data.on_invalid=skip"))
    assert manifest["counts"]["skipped"] == {"no_assistant": 1}
    assert [r["source_index"] for r in read_rows(out)] == [0, 1, 2, 4]

    no_template = tmp_path / "no-template"
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(no_template)
    debug_args = ["generate", "--model", str(tiny_qwen3), "--data", str(data), "--devices", "cpu"]
    result = CliRunner().invoke(
        cli,
        [*debug_args, "--out", str(tmp_path / "o2"), "--set", f"target.tokenizer={no_template}"],
    )
    assert result.exit_code != 0
    assert "has no chat_template" in result.output and "data.format=text" in result.output

    result = CliRunner().invoke(cli, [*debug_args, "--out", str(data)])
    assert result.exit_code != 0 and "is a file" in result.output


def test_two_ranks_write_the_same_rows(chat_out: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    """Data parallel over two CPU processes (torchrun's launcher, gloo): each writes its own
    chunks, and together they are the single process's rows, byte for byte."""
    data = Path(read_manifest(chat_out)["content"]["data"]["path"])
    manifest = run_generate(config(tiny_qwen3, data, tmp_path / "out", "run.devices=cpu,cpu"))
    assert manifest["complete"] and manifest["counts"]["rows_out"] == len(CONVERSATIONS)
    assert digests(tmp_path / "out") == digests(chat_out)


def test_second_writer_refused(chat_out: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    """One `dflash generate` per output folder: a second is refused naming the first."""
    data = Path(read_manifest(chat_out)["content"]["data"]["path"])
    out = tmp_path / "out"
    with (
        output_lock(out),
        pytest.raises(ValueError, match=rf"another `dflash generate` \(pid {os.getpid()} on host"),
    ):
        run_generate(config(tiny_qwen3, data, out))
    manifest = run_generate(config(tiny_qwen3, data, out, "output.overwrite=true"))
    assert manifest["complete"] and digests(out) == digests(chat_out)


def test_chat_template_kwargs_reach_generate_and_extract(tiny_qwen3: Path, tmp_path: Path) -> None:
    """`data.chat_template_kwargs` (e.g. Qwen3's enable_thinking) render the prompts the
    target answers and the conversations extract stores, the same way."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and quiet %}[quiet] {% endif %}{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if quiet %}[quiet] {% endif %}"
        "{% endif %}"
    )
    model_dir = tmp_path / "target"
    AutoModelForCausalLM.from_pretrained(tiny_qwen3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows()[:1])
    kwargs = "data.chat_template_kwargs={quiet: true}"
    run_generate(config(model_dir, data, tmp_path / "out", kwargs))
    (row,) = read_rows(tmp_path / "out")
    prompt = tokenizer.apply_chat_template(
        row["messages"][:1], add_generation_prompt=True, tokenize=False, quiet=True
    )
    assert prompt.endswith("[quiet] ")
    expected = greedy_reply(model_dir, tokenizer(prompt, add_special_tokens=False)["input_ids"], 6)
    assert row["messages"][1]["content"] == tokenizer.decode(expected, skip_special_tokens=False)

    debug = Path(__file__).parents[1] / "configs" / "debug.yaml"
    for flag, marked in (([kwargs], True), ([], False)):
        extract = build_config(
            ExtractConfig,
            debug,
            "extract",
            [f"data.path={data}", "target.model=m", "store.out=o", *flag],
        )
        doc = prepare_documents(extract.data, tokenizer).dataset[0]
        text = tokenizer.decode(doc["input_ids"])
        assert ("[quiet]" in text) == marked
        loss_text = tokenizer.decode(
            [t for t, m in zip(doc["input_ids"], doc["loss_mask"], strict=True) if m]
        )
        assert loss_text.strip().startswith("A number with") and "[quiet]" not in loss_text


def test_bench_generate_runs_tiny(tmp_path: Path) -> None:
    """The device benchmark's code path, checked on the CPU (no timing asserted)."""
    import subprocess
    import sys

    bench = Path(__file__).parents[1] / "bench" / "bench_generate.py"
    args = ["--tiny", "--prompts", "4", "--prompt-tokens", "16", "--new-tokens", "3"]
    done = subprocess.run(
        [sys.executable, str(bench), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(tmp_path)},
        check=True,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["new_tokens"] == 4 * 3  # random weights never stop early
    assert json.loads((tmp_path / "generate-bench.json").read_text()) == result


def test_rerun_removes_a_killed_runs_temporary_files(
    chat_out: Path, tiny_qwen3: Path, tmp_path: Path
) -> None:
    """A kill mid-write leaves `.tmp-*` files (never committed); the next run clears them."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(chat_out, out)
    (out / ".tmp-part-000001.jsonl.gz-999").write_bytes(b"half a file")
    (out / ".dflash-generate" / ".tmp-chunk-000001.json-999").write_text("{")
    data = Path(read_manifest(chat_out)["content"]["data"]["path"])
    run_generate(config(tiny_qwen3, data, out))
    assert not list(out.glob(".tmp-*")) and not list((out / ".dflash-generate").glob(".tmp-*"))
    assert digests(out) == digests(chat_out)


# a document that holds special tokens as text: documents joined by an end of text, chat
# markers in raw text; the tokenizer reads each as its id (as extract's does)
SPECIAL_TEXT = "the quick brown fox<|endoftext|>jumps over<|im_start|> the lazy dog " * 4


@pytest.mark.parametrize("stop", [True, False], ids=["stop_at_eos", "past_eos"])
def test_text_rows_keep_the_documents_special_tokens(
    tiny_qwen3: Path, tmp_path: Path, stop: bool
) -> None:
    """The target continued the window's ids, special tokens included: the written prompt keeps
    them as their text, so extract's tokens are the ones it was conditioned on (both modes),
    and the completion is the target's reply, as the rows of plain text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": SPECIAL_TEXT}])
    mode = [] if stop else ["text.stop_at_eos=false"]
    run_generate(config(tiny_qwen3, data, tmp_path / "split", "text.loss_on_prompt=false", *mode))
    run_generate(config(tiny_qwen3, data, tmp_path / "text", *mode))
    rows = read_rows(tmp_path / "split")
    ids = tokenizer(SPECIAL_TEXT, add_special_tokens=False)["input_ids"]
    specials = set(tokenizer.all_special_ids)
    windows = [ids[s : s + 12] for s in text_windows(ids, 12, 20)]
    assert [r["window_start"] for r in rows] == text_windows(ids, 12, 20)
    assert sum(bool(specials & set(w)) for w in windows) >= 2, "no window holds a special token"
    for row, prompt in zip(rows, windows, strict=True):
        assert tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] == prompt
        reply = greedy_reply(tiny_qwen3, prompt, 5, stop)
        # the reply with the special tokens it wrote as text (not the stop token)
        whole = tokenizer.decode(prompt + reply, skip_special_tokens=False)
        assert (
            row["completion"] == whole[len(tokenizer.decode(prompt, skip_special_tokens=False)) :]
        )
    texts = [r["text"] for r in read_rows(tmp_path / "text")]
    assert texts == [r["prompt"] + r["completion"] for r in rows]
    # extract's tokens of a prompt row: the ids the target saw
    prepared = prepare_documents(
        extract_config(tiny_qwen3, tmp_path / "split", tmp_path / "store").data, tokenizer
    )
    for doc, prompt in zip(prepared.dataset, windows, strict=True):
        assert doc["input_ids"][: len(prompt)] == prompt


@pytest.mark.parametrize(
    "template", ["$A", "<|endoftext|> $A", "$A <|endoftext|>"], ids=["plain", "bos", "eos"]
)
def test_completion_rows_keep_the_prompts_special_tokens(
    tiny_qwen3: Path, tmp_path: Path, template: str
) -> None:
    """Completion rows: the written prompt re-tokenizes to the ids the target continued, its
    special tokens included; the tokenizer's BOS is not written as text (extract adds it again)
    and the EOS it appends is neither fed nor written (the completion continues the prompt)."""
    from tokenizers import processors

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    model_dir = tiny_qwen3
    if template != "$A":
        first = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<|endoftext|>", first)]
        )
        model_dir = tmp_path / "target"
        AutoModelForCausalLM.from_pretrained(tiny_qwen3).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    prompts = ["Say<|im_start|> hi<|endoftext|>the quick brown fox", "import os\nimport sys\n"]
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": "x"} for p in prompts])
    run_generate(config(model_dir, data, tmp_path / "out"))
    rows = read_rows(tmp_path / "out")
    assert [r["source_index"] for r in rows] == [0, 1]
    appended = template.endswith("<|endoftext|>")
    for row, prompt in zip(rows, prompts, strict=True):
        ids = tokenizer(prompt)["input_ids"][: -1 if appended else None]
        assert tokenizer(row["prompt"])["input_ids"][: -1 if appended else None] == ids
        reply = greedy_reply(model_dir, ids, 6)
        whole = tokenizer.decode(ids + reply, skip_special_tokens=False)
        assert row["completion"] == whole[len(tokenizer.decode(ids, skip_special_tokens=False)) :]


def test_json_output_has_no_nan(tmp_path: Path) -> None:
    from dflash_offline.options import echo_json

    echo_json({"eval_loss": float("nan"), "acc": [1.0, float("inf")]}, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == {"eval_loss": None, "acc": [1.0, None]}


def test_text_windows_follow_the_tokenizers_bos(tiny_qwen3: Path, tmp_path: Path) -> None:
    """A tokenizer that puts a BOS before every text (Llama): extract will see BOS + window, so
    the target writes its continuation after BOS + window too."""
    from tokenizers import processors

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert tokenizer("a b")["input_ids"][0] == bos
    model_dir = tmp_path / "target"
    AutoModelForCausalLM.from_pretrained(tiny_qwen3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": TEXTS[0]}])
    run_generate(config(model_dir, data, tmp_path / "out", "text.loss_on_prompt=false"))
    rows = read_rows(tmp_path / "out")
    ids = tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    for row in rows:
        prompt = [bos, *ids[row["window_start"] : row["window_start"] + 12]]
        reply = greedy_reply(model_dir, prompt, 5)
        assert (
            row["completion"]
            == tokenizer.decode(prompt[1:] + reply, skip_special_tokens=False)[len(row["prompt"]) :]
        )
        assert tokenizer(row["prompt"])["input_ids"][0] == bos  # what extract will see


@pytest.mark.parametrize("target", ["tiny_qwen3", "tiny_llama"])
def test_static_kv_cache_writes_the_same_rows(
    target: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """run.kv_cache=static (transformers' StaticCache, compiled on a GPU) and preallocated
    (written in place) are speed options only: chat and text rows, batched with left padding,
    come out as with the growing cache, and the text replies are the target's uncached greedy
    ones."""
    model = request.getfixturevalue(target)
    rows = chat_rows() + [{"text": t} for t in TEXTS]
    written = {}
    for cache in ("dynamic", "static", "preallocated"):
        for kind, data_rows in (
            ("chat", rows[: len(CONVERSATIONS)]),
            ("text", rows[len(CONVERSATIONS) :]),
        ):
            data = write_jsonl(tmp_path / f"{kind}.jsonl", data_rows)
            out = tmp_path / f"{cache}-{kind}"
            run_generate(config(model, data, out, f"run.kv_cache={cache}", "run.batch_size=4"))
            written[cache, kind] = read_rows(out)
    for kind in ("chat", "text"):
        assert written["static", kind] == written["dynamic", kind]
        assert written["preallocated", kind] == written["dynamic", kind]
    tokenizer = AutoTokenizer.from_pretrained(model)
    for row in written["static", "text"]:
        ids = tokenizer(TEXTS[row["source_index"]], add_special_tokens=False)["input_ids"]
        prompt = ids[row["window_start"] : row["window_start"] + 12]
        assert row["new_tokens"] == len(greedy_reply(model, prompt, 5, stored=False))


@pytest.mark.parametrize("target", ["tiny_qwen3", "tiny_llama"])
def test_gqa_decode_attention_writes_the_same_rows(
    target: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """target.attn_implementation=sdpa_gqa_decode is a speed option only: chat rows (left
    padded, a mask) and text windows (equal lengths, no mask) come out as with sdpa, and the
    decode steps did run on the key/value heads (2 of the tiny targets' 4 query heads each)."""
    model = request.getfixturevalue(target)
    rows = chat_rows() + [{"text": t} for t in TEXTS]
    packed_shapes = []
    sdpa = gqa_decode.F.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        packed_shapes.append(tuple(query.shape[1:3]))  # (key/value heads, query rows)
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(gqa_decode, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    written = {}
    for attn in ("sdpa", gqa_decode.GQA_DECODE):
        for kind, data_rows in (
            ("chat", rows[: len(CONVERSATIONS)]),
            ("text", rows[len(CONVERSATIONS) :]),
        ):
            data = write_jsonl(tmp_path / f"{kind}.jsonl", data_rows)
            out = tmp_path / f"{attn}-{kind}"
            extra = (f"target.attn_implementation={attn}", "run.batch_size=4")
            run_generate(config(model, data, out, *extra))
            written[attn, kind] = read_rows(out)
    for kind in ("chat", "text"):
        assert written[gqa_decode.GQA_DECODE, kind] == written["sdpa", kind]
    assert packed_shapes and set(packed_shapes) == {(2, 2)}


def test_kv_cache_setting_checked(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": TEXTS[0]}])
    result = CliRunner().invoke(
        cli,
        ["generate", "--model", str(tiny_qwen3), "--data", str(data), "--out", str(tmp_path / "o"),
         "--devices", "cpu", "--set", "run.kv_cache=paged"],
    )  # fmt: skip
    assert result.exit_code != 0 and "kv_cache" in result.output and "static" in result.output


def test_static_kv_cache_stays_within_batch_tokens(tiny_qwen3: Path) -> None:
    """transformers sizes every static cache to the longest (prompt + new) it has seen on the
    model, not to the batch's own: the backend plans rows by that length, so a batch of short
    prompts after a long one holds no more than run.batch_tokens of KV cache (the bound the
    growing cache keeps), in one call as across calls (chat turns, chunks)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    caches = []  # (rows, cache length) of every static cache generate allocates
    allocate = model._prepare_static_cache

    def spy(*args, **kwargs):
        cache = allocate(*args, **kwargs)
        caches.append((kwargs["batch_size"], model._previous_max_cache_length))
        return cache

    model._prepare_static_cache = spy
    stops = stop_token_ids(tokenizer, None, {})
    budget = 8 * 24
    backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 8, budget, "static")
    long_prompt, short_prompts = [[5] * 100], [[6] * 8] * 8
    replies = backend.generate(long_prompt + short_prompts, 8)  # one call: long batch first
    assert len(replies) == 9 and len(caches) >= 2
    backend.generate(short_prompts, 8)  # a later call: the cache is as long as before
    assert all(rows * length <= budget for rows, length in caches), caches


def test_tf32_matmuls_keyed_recorded_and_shown(tiny_qwen3: Path, tmp_path: Path) -> None:
    """target.matmul_precision=high (TF32 on GPUs) can change near-tie replies: it is part of
    the dataset's key and provenance when on, and absent when off, so that datasets generated
    before the option existed keep their keys; load_target sets the process's CUDA flag."""
    from stage1_extract.target import load_target
    from stage1_generate.inputs import build_manifest, read_inputs

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    default = config(tiny_qwen3, data, tmp_path / "out")
    tf32 = config(tiny_qwen3, data, tmp_path / "out", "target.matmul_precision=high")
    inputs = read_inputs(default)
    off = build_manifest(default, inputs.raw, inputs.fmt, [])
    on = build_manifest(tf32, inputs.raw, inputs.fmt, [])
    assert "matmul_precision" not in off["content"]["target"]
    assert on["content"]["target"]["matmul_precision"] == "high"
    assert on["key"] != off["key"]
    bf16 = config(tiny_qwen3, data, tmp_path / "out", "target.matmul_precision=high")
    bf16.target.dtype = "bfloat16"  # its matmuls are bf16 either way: the same rows, the same key
    bf16_default = config(tiny_qwen3, data, tmp_path / "out")
    bf16_default.target.dtype = "bfloat16"
    assert (
        build_manifest(bf16, inputs.raw, inputs.fmt, [])["key"]
        == build_manifest(bf16_default, inputs.raw, inputs.fmt, [])["key"]
    )

    def sampling_row(manifest: dict) -> str:
        rows = _generation_rows({"content": manifest["content"]})
        return next(text for _, text in rows if "new tokens per turn" in text)

    assert sampling_row(on).endswith("(TF32 matmuls)")
    assert "TF32" not in sampling_row(off)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        load_target(tf32.target.as_target_config(), torch.device("cpu"))
        assert torch.backends.cuda.matmul.allow_tf32
        load_target(default.target.as_target_config(), torch.device("cpu"))
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_the_targets_generation_config_does_not_shape_the_rows(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """A target whose generation_config.json sets a repetition penalty (Qwen2.5-Instruct ships
    1.05): greedy rows stay the target's argmax, the text a greedy-verified drafter predicts;
    the token ids and the KV cache it names are kept."""
    import shutil

    from transformers import GenerationConfig

    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    own = GenerationConfig.from_pretrained(tiny_qwen3)
    own.repetition_penalty, own.no_repeat_ngram_size = 3.0, 2
    own.save_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert model.generation_config.repetition_penalty == 3.0
    tokenizer = AutoTokenizer.from_pretrained(target)
    stops = stop_token_ids(tokenizer, None, {})
    prompts = [[5, 17, 9, 23, 5, 17], [40, 41, 40, 41], [7] * 9]
    backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 2, 1 << 20, "dynamic")
    got = [c.token_ids for c in backend.generate(prompts, 10)]
    assert got == [greedy_reply(tiny_qwen3, p, 10, stored=False) for p in prompts]
    assert model.generation_config.repetition_penalty in (None, 1.0)  # unset (transformers 5)
    assert model.generation_config.no_repeat_ngram_size in (None, 0)
    assert model.generation_config.pad_token_id == own.pad_token_id is not None


def test_a_chunk_of_empty_text_rows_is_skipped_not_a_crash(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    rows = [{"text": TEXTS[0]}, {"text": TEXTS[2]}, {"text": ""}, {"text": "  "}]  # chunk 1: none
    data = write_jsonl(tmp_path / "text.jsonl", rows)
    manifest = run_generate(config(tiny_qwen3, data, tmp_path / "out", "data.on_invalid=skip"))
    assert manifest["complete"] and manifest["counts"]["skipped"] == {"empty_text": 2}
    assert {r["source_index"] for r in read_rows(tmp_path / "out")} == {0, 1}


def test_a_window_cut_inside_a_character_keeps_the_whole_text(tiny_qwen3: Path) -> None:
    """A prompt window that ends inside a character of several byte tokens: the row's prompt
    ends before that character, and prompt + completion is the whole text at every cut."""
    from stage1_generate.rows import _split_row

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    ids = tokenizer("hello \U0001f600 world", add_special_tokens=False)["input_ids"]
    whole = tokenizer.decode(ids)
    assert len(ids) >= 5  # the emoji spans several byte tokens
    for cut in range(1, len(ids)):
        reply = ids[cut:]
        completion = Completion(tokenizer.decode(reply), len(reply), True, reply)
        row = _split_row(tokenizer, ids[:cut], completion, as_text=False)
        assert row["prompt"] + row["completion"] == whole, cut
        assert "\ufffd" not in row["prompt"] + row["completion"]


class ContinuingBackend:
    """A backend that continues each prompt with the next tokens of the document it was cut
    from (or " ok" at its end), as a target that knew the documents would; keeps the prompts."""

    max_positions, max_positions_source = None, "none"

    def __init__(self, documents: list[list[int]], ending: list[int]) -> None:
        self.documents, self.ending, self.prompts = documents, ending, []

    def _reply(self, prompt: list[int]) -> list[int]:
        for ids in self.documents:
            for at in range(len(ids) - len(prompt) + 1):
                if ids[at : at + len(prompt)] == prompt:
                    return ids[at + len(prompt) : at + len(prompt) + 3] or self.ending
        raise AssertionError(f"prompt {prompt} is in no document")

    def generate(self, prompts, max_new_tokens, on_batch=None, stop=True):  # noqa: ANN001, ANN201
        from stage1_generate.local_backend import Completion

        self.prompts += prompts
        replies = [self._reply(p) for p in prompts]
        return [Completion("ok", len(r), True, r) for r in replies]


@pytest.mark.parametrize("loss_on_prompt", ["true", "false"])
def test_a_window_starting_inside_a_character_starts_at_the_next_one(
    tiny_qwen3: Path, tmp_path: Path, loss_on_prompt: str
) -> None:
    """A window whose first tokens are the last bytes of a character (byte-level BPE split it)
    starts at the next token that begins a character, its end kept: its text has no leading
    U+FFFD and the target was asked for exactly that text. Windows that start cleanly are as
    before (ASCII text: every window), and a U+FFFD of the document itself is kept."""
    from stage1_generate.rows import generate_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    texts = ["日本語のテキスト naïve café " * 2, "the quick brown fox " * 2, "a b c d \ufffd f g"]
    documents = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    cfg = config(tiny_qwen3, tmp_path / "unused.jsonl", tmp_path / "out", "text.prompt_tokens=4")
    cfg.text.stride, cfg.text.loss_on_prompt = 5, loss_on_prompt == "true"
    backend = ContinuingBackend(documents, tokenizer(" ok", add_special_tokens=False)["input_ids"])
    result = generate_text(texts, [0, 1, 2], cfg, tokenizer, backend)
    assert len(backend.prompts) == len(result.rows)
    moved = 0
    for row, prompt in zip(result.rows, backend.prompts, strict=True):
        ids, start = documents[row["source_index"]], row["window_start"]
        planned = max(s for s in text_windows(ids, 4, 5) if s <= start)
        moved += start != planned
        assert prompt == ids[start : planned + 4]  # the window's end stays
        written = row["text"] if "text" in row else row["prompt"] + row["completion"]
        # no U+FFFD the text does not hold (but at the end: a reply cut at its token limit may
        # end inside a character)
        assert written.rstrip("\ufffd") in texts[row["source_index"]] + " ok"
    assert moved  # the Japanese text has windows that began inside a character
    starts = [(r["source_index"], r["window_start"]) for r in result.rows]
    own = [r for r in result.rows if r["source_index"] == 2 and r["window_start"] == 5]
    assert (own[0].get("text") or own[0]["prompt"]).startswith("\ufffd f")
    for index in (1, 2):  # ASCII, and a document's own U+FFFD: the windows as planned
        assert [s for i, s in starts if i == index] == text_windows(documents[index], 4, 5)


def test_empty_assistant_turns_are_places_for_the_targets_replies(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """A prompt-only chat set (assistant turns left empty): generate writes them, it does not
    skip the row as extract would (extract has no loss tokens in it; generate fills them)."""
    rows = [
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": ""}]}
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    manifest = run_generate(config(tiny_qwen3, data, tmp_path / "out"))
    (row,) = read_rows(tmp_path / "out")
    assert manifest["counts"]["skipped"] == {} and row["generated_turns"] == 1
    assert row["messages"][0] == rows[0]["messages"][0]


def test_the_bar_follows_a_batch_token_by_token(
    tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A batch's tokens reached the bar only when the whole batch ended: on 2 CPU cores a
    pystd-28m batch ran 43 s to 4 minutes with the bar at 0 and no figure moving. The note
    changes nothing generated."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    stops = stop_token_ids(tokenizer, None, {})
    prompts = [[5, 17, 9, 23, 5, 17], [40, 41, 40, 41], [7] * 9]
    backend = LocalBackend(model, tokenizer, SamplingConfig(), stops, 2, 1 << 20, "dynamic")
    quiet = [c.token_ids for c in backend.generate(prompts, 10, stop=False)]
    notes: list[tuple[int, int, int, int, int]] = []
    backend.on_step = lambda *note: notes.append(note)
    assert [c.token_ids for c in backend.generate(prompts, 10, stop=False)] == quiet
    # each batch's first step is shown at once (later ones at most every 0.5 s)
    assert notes[0] == (1, 2, 2, 1, 10) and (2, 2, 1, 1, 10) in notes
    assert all(1 <= step <= 10 for *_, step, _ in notes)

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    run_generate(config(tiny_qwen3, data, tmp_path / "out", "run.progress=true"))
    assert "batch 1/1: 2 rows at token 1/6" in capsys.readouterr().err


def test_text_windows_are_not_called_cut(tiny_eos_target: Path, tmp_path: Path) -> None:
    """A window is meant to run to text.new_tokens: the summary said "23 replies cut at the
    token limit" of every pystd recipe window, as of a fault (and so did `dflash inspect`);
    it now counts the windows of that length and those the end of text ended sooner."""
    import logging

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    lines = Lines()
    logging.getLogger("dflash").addHandler(lines)
    try:
        manifest = run_generate(
            config(tiny_eos_target, data, tmp_path / "out", "text.new_tokens=8")
        )
    finally:
        logging.getLogger("dflash").removeHandler(lines)
    counts = manifest["counts"]
    assert 0 < counts["truncated"] < counts["prompts"]  # some windows met the end of text
    summary = next(line for line in lines.lines if line.startswith("generated "))
    ended = counts["prompts"] - counts["truncated"]
    assert f"{counts['truncated']} windows of text.new_tokens, {ended} ended sooner" in summary
    assert "cut at the token limit" not in summary
    shown = [text for _, text in _generation_rows(manifest)]  # `dflash inspect`'s lines
    assert any(f"{ended} ended sooner" in text for text in shown), shown
    assert not any("cut at the limit" in text for text in shown)
