"""The special tokens a tokenizer adds to a text by default: a BOS before it (Llama: what the
target was trained to see first, kept), an EOS after it (a tokenizer set to add one, e.g.
`add_eos_token=True`: it says the document ended, which a text row does not say and a prompt
contradicts, left out). Checked for extract's text, completion and chat rows and for what
generate feeds the target, against ids written out from the pieces: BOS id, then the text's own
ids (`add_special_tokens=False`), an EOS only where the data holds one."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import datasets
import pytest
from tokenizers import processors
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerBase

from common.config import build_config
from common.generated import PROMPT_SUFFIX_LEFT_OUT, manifest_path
from common.store import StoreError
from common.tiny import CHATML_TEMPLATE, build_tokenizer, example_texts
from stage1_extract import data
from stage1_extract import job as extract_job
from stage1_extract.config import DataConfig, ExtractConfig
from stage1_extract.data import prepare_documents
from stage1_extract.job import plan_job
from stage1_extract.store_root import prepare_store
from stage1_generate.config import GenerateConfig
from stage1_generate.rows import text_windows
from stage1_generate.run import run_generate

BOS, EOS = "<|endoftext|>", "<|im_end|>"  # EOS: the tokenizer's eos_token and ChatML's end
# post-processor templates, as tokenizer.json files carry them; "llama": LlamaTokenizer's flags
KINDS = {
    "none": "$A",
    "bos": f"{BOS} $A",
    "eos": f"$A {EOS}",
    "both": f"{BOS} $A {EOS}",
    "llama": "add_bos_token + add_eos_token",
}
DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
GENERATION_TEMPLATE = (  # ChatML with {% generation %} tags (transformers' assistant mask)
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{{ '\\n' }}{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def make_tokenizer(kind: str) -> PreTrainedTokenizerBase:
    tok = build_tokenizer(example_texts())
    if kind == "llama":
        tok = LlamaTokenizer(
            tokenizer_object=tok.backend_tokenizer,
            bos_token=BOS,
            eos_token=EOS,
            add_bos_token=True,
            add_eos_token=True,
        )
        tok.chat_template = CHATML_TEMPLATE
    elif kind != "none":
        ids = [(t, tok.convert_tokens_to_ids(t)) for t in (BOS, EOS) if t in KINDS[kind]]
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=KINDS[kind], special_tokens=ids
        )
    return tok


def has_bos(kind: str) -> bool:
    return kind in ("bos", "both", "llama")


def appends_eos(kind: str) -> bool:
    return kind in ("eos", "both", "llama")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def plain(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_text_and_completion_rows_keep_the_bos_and_leave_out_an_appended_eos(
    kind: str, tmp_path: Path
) -> None:
    tok = make_tokenizer(kind)
    bos, eos = [tok.convert_tokens_to_ids(BOS)], tok.convert_tokens_to_ids(EOS)
    # the premise: this tokenizer does append an EOS to a text (or does not)
    assert (tok("x")["input_ids"][-1] == eos) == appends_eos(kind)
    start = bos if has_bos(kind) else []
    # the second text ends with an end of text the data holds: kept, once
    texts = ["Hello there.", f"Done.{EOS}", "while True: pass\n" * 40]
    docs = prepare_documents(
        DataConfig(path=str(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]))), tok
    ).dataset
    for doc, text in zip(docs, texts, strict=True):
        assert doc["input_ids"] == start + plain(tok, text)
        assert doc["loss_mask"] == [1] * len(doc["input_ids"])
    assert docs[1]["input_ids"][-2:] != [eos, eos] and docs[1]["input_ids"][-1] == eos

    pairs = [("Say", " hello."), ("", "Hi there.")]  # an empty prompt still gets the BOS
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    docs = prepare_documents(DataConfig(path=str(path)), tok).dataset
    for doc, (prompt, completion) in zip(docs, pairs, strict=True):
        context = start + plain(tok, prompt)
        assert doc["input_ids"] == context + plain(tok, completion)
        assert doc["loss_mask"] == [0] * len(context) + [1] * len(plain(tok, completion))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("template", ["chatml", "generation_tags", "bos_first"])
def test_chat_rows_hold_the_templates_tokens_only(kind: str, template: str, tmp_path: Path):
    """The chat template writes every special token (its own BOS too): the tokenizer's defaults
    add nothing, whatever they are."""
    tok = make_tokenizer(kind)
    tok.add_special_tokens({"bos_token": BOS})
    tok.chat_template = {
        "chatml": CHATML_TEMPLATE,
        "generation_tags": GENERATION_TEMPLATE,
        "bos_first": "{{ bos_token }}" + CHATML_TEMPLATE,  # Llama 3 writes its BOS so
    }[template]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    doc = prepare_documents(DataConfig(path=str(path)), tok).dataset[0]
    pieces = [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0), ("Hello.", 1)]
    pieces += [(EOS, 1), ("\n", 0)]
    if template == "bos_first":
        pieces.insert(0, (BOS, 0))
    ids = [i for text, _ in pieces for i in plain(tok, text)]
    mask = [loss for text, loss in pieces for _ in plain(tok, text)]
    assert doc["input_ids"] == ids and doc["loss_mask"] == mask


def test_a_tokenization_cached_with_the_eos_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """datasets keys its map cache by the function's name and arguments, not its code: a rerun
    over the same data and tokenizer must not read back the rows an earlier version wrote with
    the EOS (simulated by hiding the suffix)."""
    tok = make_tokenizer("eos")
    eos = tok.convert_tokens_to_ids(EOS)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello there."}])
    with monkeypatch.context() as patch:
        patch.setattr(data, "special_affixes", lambda tokenizer: ([], []))
        older = prepare_documents(DataConfig(path=str(path)), tok).dataset
    assert older[0]["input_ids"][-1] == eos and older.cache_files
    assert prepare_documents(DataConfig(path=str(path)), tok).dataset[0]["input_ids"] == plain(
        tok, "Hello there."
    )


def _lines(folder: Path) -> list[str]:
    return [
        line
        for part in sorted(folder.glob("part-*.jsonl.gz"))
        for line in gzip.decompress(part.read_bytes()).decode().splitlines()
    ]


@pytest.fixture(scope="module")
def eos_target(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3 with a tokenizer that appends its EOS to every text."""
    out = tmp_path_factory.mktemp("eos-target") / "target"
    shutil.copytree(tiny_qwen3, out)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", special_tokens=[(EOS, tok.convert_tokens_to_ids(EOS))]
    )
    tok.save_pretrained(out)
    return out


def generate_config(model: Path, data_path: Path, out: Path, *extra: str) -> GenerateConfig:
    flags = [f"target.model={model}", f"data.path={data_path}", f"output.out={out}"]
    flags += ["target.dtype=float32", "run.devices=cpu", "run.progress=false"]
    flags += ["sampling.max_new_tokens=5", "text.prompt_tokens=12", "text.new_tokens=5"]
    return build_config(GenerateConfig, None, "generate", [*flags, "text.stride=20", *extra])


def extract_config(model: Path, data_path: Path, store: Path) -> ExtractConfig:
    flags = [f"target.model={model}", f"data.path={data_path}", f"store.out={store}"]
    return build_config(ExtractConfig, DEBUG, "extract", flags)


def test_generated_text_windows_are_stored_as_the_target_saw_them(
    eos_target: Path, tmp_path: Path
) -> None:
    """A window is fed to the target without the EOS (it continues the document); extract
    stores it the same way, with no EOS after the prompt ({prompt, completion}) or the
    reply (one text row), and keys the store by the left-out suffix."""
    tok = AutoTokenizer.from_pretrained(eos_target)
    eos = tok.convert_tokens_to_ids(EOS)
    source = "the quick brown fox jumps over the lazy dog " * 4
    path = write_jsonl(tmp_path / "src.jsonl", [{"text": source}])
    run_generate(generate_config(eos_target, path, tmp_path / "split", "text.loss_on_prompt=false"))
    manifest = run_generate(generate_config(eos_target, path, tmp_path / "text"))
    assert PROMPT_SUFFIX_LEFT_OUT not in manifest["content"]  # text windows: as before
    ids = plain(tok, source)
    windows = [ids[s : s + 12] for s in text_windows(ids, 12, 20)]
    split = prepare_documents(DataConfig(path=str(tmp_path / "split")), tok)
    assert split.format == "completion" and len(split.dataset) == len(windows)
    rows = [json.loads(line) for line in _lines(tmp_path / "split")]
    for doc, window, row in zip(split.dataset, windows, rows, strict=True):
        reply = plain(tok, row["completion"])
        assert doc["input_ids"] == window + reply
        assert doc["loss_mask"] == [0] * len(window) + [1] * len(reply)
    whole = prepare_documents(DataConfig(path=str(tmp_path / "text")), tok)
    for doc, row in zip(whole.dataset, rows, strict=True):
        assert doc["input_ids"] == plain(tok, row["prompt"] + row["completion"])
        assert doc["input_ids"][-1] != eos and all(doc["loss_mask"])

    job = plan_job(extract_config(eos_target, tmp_path / "text", tmp_path / "store"))
    assert job.attrs["tokenizer"]["suffix_left_out"] == [eos]
    # a store begun by a version that stored the EOS (its key and root without the record)
    # is not resumed with shards of the new documents
    old = json.loads(json.dumps(job.attrs))
    del old["tokenizer"]["suffix_left_out"]
    old["content_key"] = "written-with-the-eos"
    prepare_store(tmp_path / "store", old, overwrite=False)
    with pytest.raises(StoreError, match="tokenizer's appended end of sequence"):
        prepare_store(tmp_path / "store", job.attrs, overwrite=False)


def test_a_store_of_a_tokenizer_without_suffix_records_none(tiny_qwen3: Path, tmp_path: Path):
    """The record is there only for a tokenizer that appends: other stores keep their key."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello there."}])
    job = plan_job(extract_config(tiny_qwen3, path, tmp_path / "store"))
    assert "suffix_left_out" not in job.attrs["tokenizer"]


def test_generated_completions_follow_the_prompt_without_the_eos(
    eos_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completion rows: the target writes after the prompt as extract stores it (no EOS), the
    manifest says so, and a finished folder of an older version (which fed the EOS) is refused
    by extract instead of storing its completions after a context they were not written in,
    before its rows are tokenized (minutes on a large folder)."""
    tok = AutoTokenizer.from_pretrained(eos_target)
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "import os\nimport", "completion": "x"}])
    out = tmp_path / "out"
    manifest = run_generate(generate_config(eos_target, path, out))
    assert manifest["content"][PROMPT_SUFFIX_LEFT_OUT] == [tok.convert_tokens_to_ids(EOS)]
    [row] = [json.loads(line) for line in _lines(out)]
    doc = plan_job(extract_config(eos_target, out, tmp_path / "store")).prepared.dataset[0]
    prompt, reply = plain(tok, "import os\nimport"), plain(tok, row["completion"])
    assert doc["input_ids"] == prompt + reply
    assert doc["loss_mask"] == [0] * len(prompt) + [1] * len(reply)
    del manifest["content"][PROMPT_SUFFIX_LEFT_OUT]
    manifest_path(out).write_text(json.dumps(manifest))

    def tokenized(*args: object) -> None:
        raise AssertionError("the rows were tokenized before the folder was refused")

    monkeypatch.setattr(extract_job, "prepare_documents", tokenized)
    with pytest.raises(ValueError, match=r"older `dflash generate`.*--overwrite"):
        plan_job(extract_config(eos_target, out, tmp_path / "store"))


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_prompts_keep_the_bos_and_leave_out_an_appended_eos(kind: str, tmp_path: Path):
    from evaluation.online import EvaluateConfig, load_prompts

    tok = make_tokenizer(kind)
    texts = ["def add(a, b):", "import os\nprint(os.getcwd())"]
    path = write_jsonl(tmp_path / "dev.jsonl", [{"text": t} for t in texts])
    prompts = load_prompts(EvaluateConfig(target="unused", data=str(path)), tok)
    bos = [tok.convert_tokens_to_ids(BOS)] if has_bos(kind) else []
    # a short text whole: what the target sees of it is the document so far, never its end
    assert prompts == [bos + plain(tok, t) for t in texts]
    cut = load_prompts(EvaluateConfig(target="unused", data=str(path), prompt_tokens=3), tok)
    assert cut == [(bos + plain(tok, t))[:3] for t in texts]
