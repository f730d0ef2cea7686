"""`dflash extract` on tiny targets: stored values against a fresh forward of each document
alone, the packed layout against the document arrays, the root attributes, and bad inputs
(clear error, exit code 2, shards already written untouched)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from log_capture import dflash_messages
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.config import build_config
from common.logging import LOGGER_NAME
from common.store import HEAD_FILE, bits_to_bf16, committed_shards, open_store
from common.tiny import EXAMPLE_DATA
from dflash_offline.cli import main as cli
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
BF16 = "store.hidden_dtype=bfloat16"  # where bf16 features are the subject (the default: nvfp4)
SMALL = [
    "packing.seq_len=64",
    "store.sequences_per_shard=2",
    "store.chunk_tokens=32",
    "run.batch_tokens=256",
    "run.writer_threads=2",
    "run.progress=false",
    "verifier.head_chunk_tokens=50",
]


SHORT_ROWS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [("Hi", "Hello."), ("2+2?", "Four."), ("Name a color.", "Blue.")]
]


def write_data(folder: Path, num_rows: int = 8) -> Path:
    """The first rows of the shipped example conversations (most are split at seq_len 64),
    then short ones that share sequences, as a JSONL file."""
    path = folder / "data.jsonl"
    rows = EXAMPLE_DATA.read_text().splitlines()[:num_rows]
    path.write_text("\n".join(rows + [json.dumps(r) for r in SHORT_ROWS]) + "\n")
    return path


def make_config(model: Path, data: Path, out: Path, *extra: str) -> ExtractConfig:
    flags = [f"target.model={model}", f"data.path={data}", f"store.out={out}"]
    return build_config(ExtractConfig, DEBUG, "extract", [*SMALL, *flags, *extra])


def cli_extract(model: Path, data: Path, out: Path, *extra: str):
    sets = [arg for item in (*SMALL, *extra) for arg in ("--set", item)]
    args = ["extract", "--config", str(DEBUG), "--model", str(model), "--data", str(data)]
    return CliRunner().invoke(cli, [*args, "--out", str(out), *sets])


def shard_arrays(store: Path, index: int) -> dict[str, np.ndarray]:
    group = zarr.open_group(store / "shards" / f"shard-{index:06d}", mode="r")
    return {name: array[...] for name, array in group.arrays()}


def file_digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def qwen3_store(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("extract-qwen3")
    out = folder / "store"
    # layer 3 is the last one: stored after the final norm, as transformers' hidden_states[4];
    # bf16 features, which must equal a fresh forward's to the bit (fp8: tests/test_fp8.py)
    layers = "target.tapped_layers=[0,1,3]"
    run_extract(make_config(tiny_qwen3, write_data(folder), out, layers, BF16))
    return out


def fresh_forwards(store: Path, model: torch.nn.Module):
    """For every stored document: (its shard's arrays, sequence, token span, the output of a
    forward of that document alone with output_hidden_states)."""
    info = open_store(store, require_complete=True)
    for index in range(info.num_shards):
        a = shard_arrays(store, index)
        for d in range(len(a["doc_length"])):
            seq, start, length = a["doc_sequence"][d], a["doc_start"][d], a["doc_length"][d]
            span = slice(start, start + length)
            ids = torch.from_numpy(a["tokens"][seq, span].astype(np.int64))[None]
            with torch.no_grad():
                yield a, seq, span, model(ids, output_hidden_states=True)


def check_against_fresh_forward(store: Path, model_dir: Path, dtype: torch.dtype, tol: float):
    """Every stored document equals a forward of that document alone, to bf16 rounding (plus
    `tol`, relative, for bf16 kernels that differ between a padded batch and a lone row)."""
    info = open_store(store, require_complete=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    layers, k = info.tapped_layers, info.topk
    rounding = 2.0**-8  # one bf16 ulp, relative: a value near a rounding boundary may flip
    checked = 0
    for a, seq, span, ref in fresh_forwards(store, model):
        hidden = bits_to_bf16(a["hidden"][seq]).float()
        for j, layer in enumerate(layers):
            got = hidden[span, j]
            # layer i = hidden_states[i + 1], the last one included (after the final norm)
            want = ref.hidden_states[layer + 1][0].float()
            torch.testing.assert_close(got, want, rtol=rounding + tol, atol=1e-5 + tol)
        logits = ref.logits[0].float()
        # ids checked through their logits: bf16 logits tie often, and ties may order freely
        argmax = torch.from_numpy(a["target_argmax"][seq, span].astype(np.int64))
        top_ids = torch.from_numpy(a["topk_ids"][seq, span].astype(np.int64))
        top_values = torch.from_numpy(a["topk_logits"][seq, span])
        close = dict(rtol=1e-5 + tol, atol=1e-5 + tol)
        torch.testing.assert_close(
            logits.gather(1, argmax[:, None])[:, 0], logits.amax(-1), **close
        )
        torch.testing.assert_close(logits.gather(1, top_ids), top_values, **close)
        torch.testing.assert_close(top_values, logits.topk(k, dim=-1).values, **close)
        assert (top_ids.sort(-1).values.diff(dim=-1) > 0).all(), "top-k ids repeat"
        if tol == 0.0:
            assert torch.equal(argmax, logits.argmax(-1))
            assert torch.equal(top_ids, logits.topk(k, dim=-1).indices)
        lse = torch.from_numpy(a["logsumexp"][seq, span])
        torch.testing.assert_close(lse, logits.logsumexp(-1), **close)
        checked += 1
    assert checked == info.attrs["counts"]["documents"] > info.num_shards


def test_stored_values_equal_a_fresh_forward_of_each_document(qwen3_store: Path, tiny_qwen3):
    check_against_fresh_forward(qwen3_store, tiny_qwen3, torch.float32, tol=0.0)


def test_packed_layout_matches_document_arrays(qwen3_store: Path):
    info = open_store(qwen3_store, require_complete=True)
    S, sources = info.seq_len, []
    for index in range(info.num_shards):
        a = shard_arrays(qwen3_store, index)
        expected_ids = np.full(a["tokens"].shape, -1, np.int32)
        expected_pos = np.zeros(a["tokens"].shape, np.int32)
        for d, (seq, start, n) in enumerate(
            zip(a["doc_sequence"], a["doc_start"], a["doc_length"], strict=True)
        ):
            assert start + n <= S
            assert (expected_ids[seq, start : start + n] == -1).all(), "documents overlap"
            expected_ids[seq, start : start + n] = d
            expected_pos[seq, start : start + n] = np.arange(n)
        assert (a["document_ids"] == expected_ids).all()
        assert (a["position_ids"] == expected_pos).all()
        padding = expected_ids < 0
        assert (a["loss_mask"][padding] == 0).all() and (a["hidden"][padding] == 0).all()
        assert (a["tokens"][padding] == info.attrs["tokenizer"]["pad_token_id"]).all()
        sources += list(zip(a["doc_source_index"], a["doc_piece"], strict=True))
    # every source row appears with all its pieces 0..n-1, nothing twice (best-fit packing
    # may store a later piece before an earlier one: each piece is a document of its own)
    assert len(set(sources)) == len(sources)
    pieces: dict[int, list[int]] = {}
    for source, piece in sources:
        pieces.setdefault(int(source), []).append(int(piece))
    assert all(sorted(p) == list(range(len(p))) for p in pieces.values())
    counts = info.attrs["counts"]
    assert counts["source_documents"] == len({s for s, _ in sources}) == 8 + len(SHORT_ROWS)
    assert counts["documents"] > counts["sequences"]  # some sequences hold several documents
    assert counts["documents"] == len(sources) > counts["source_documents"]  # some were split
    assert counts["split_documents"] == sum(1 for s, p in sources if p == 1)
    assert counts["tokens"] + counts["padding_tokens"] == counts["sequences"] * S


def test_root_attributes_and_head_file(qwen3_store: Path, tiny_qwen3: Path):
    info = open_store(qwen3_store, require_complete=True)
    attrs = info.attrs
    assert attrs["tapped_layers"] == [0, 1, 3] and attrs["topk"] == 8 and attrs["seq_len"] == 64
    assert attrs["num_shards"] == len(committed_shards(qwen3_store)) >= 3
    assert attrs["target"]["model_type"] == "qwen3" and attrs["target"]["num_hidden_layers"] == 4
    assert attrs["dataset"]["format"] == "messages" and attrs["dataset"]["num_rows"] == 11
    assert len(attrs["content_key"]) == 64 and attrs["tokenizer"]["mask_token_id"] is not None
    head = load_file(qwen3_store / HEAD_FILE)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.bfloat16)
    assert torch.equal(head["lm_head.weight"], model.lm_head.weight)
    assert torch.equal(head["embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(head["norm.weight"], model.model.norm.weight)
    assert not list((qwen3_store / "shards").glob(".tmp-*"))


def test_bf16_llama_with_default_layers(tiny_llama: Path, tmp_path: Path):
    out = tmp_path / "store"
    run_extract(
        make_config(tiny_llama, write_data(tmp_path, 4), out, "target.dtype=bfloat16", BF16)
    )
    info = open_store(out, require_complete=True)
    assert info.tapped_layers == [0, 1, 2]  # 4 layers: 1..N-3 is too short, 0..N-2 is used
    # bf16 kernels differ slightly between a padded batch and a lone document
    check_against_fresh_forward(out, tiny_llama, torch.bfloat16, tol=3e-2)


def test_layer_ids_out_of_range_exit_2(tiny_qwen3: Path, tmp_path: Path):
    result = cli_extract(
        tiny_qwen3, write_data(tmp_path), tmp_path / "s", "target.tapped_layers=[1,4]"
    )
    assert result.exit_code == 2
    assert "[4] out of range" in result.output and "4 decoder layers" in result.output
    assert not (tmp_path / "s").exists()


def test_layers_of_a_target_whose_decoder_config_is_nested() -> None:
    """Multimodal configs nest the decoder's config under text_config: an object, or a dict
    (remote code, a config built without the sub-config's class, and config.json as the store
    keeps it). Extract reads the decoder's layers, vocabulary and width from it, and checks the
    tapped layers against its layer count."""
    from types import SimpleNamespace

    from transformers import Gemma3Config, Gemma3TextConfig, PretrainedConfig, Qwen3Config

    from stage1_extract.config import TargetConfig
    from stage1_extract.target import config_dict, resolve_tapped_layers, text_config

    sizes = dict(num_hidden_layers=6, hidden_size=32, vocab_size=50, num_attention_heads=4)
    qwen3 = Qwen3Config(**sizes)
    for config in (
        qwen3,
        config_dict(qwen3),
        Gemma3Config(text_config=Gemma3TextConfig(**sizes)),
        config_dict(Gemma3Config(text_config=Gemma3TextConfig(**sizes))),
        PretrainedConfig(text_config=qwen3.to_dict()),  # get_text_config gives the dict back
        SimpleNamespace(text_config=qwen3.to_dict()),
        {"model_type": "qwen2_5_vl", "text_config": qwen3.to_dict()},
    ):
        text = text_config(config)
        assert (text.num_hidden_layers, text.vocab_size, text.hidden_size) == (6, 50, 32)
        spread = resolve_tapped_layers(TargetConfig(num_tapped=3), text.num_hidden_layers)
        assert spread == [1, 2, 3]
        bad = TargetConfig(model="mm", tapped_layers=[1, 6])
        with pytest.raises(ValueError, match=r"\[6\] out of range: mm has 6 decoder layers"):
            resolve_tapped_layers(bad, text.num_hidden_layers)


def test_missing_model_folder_exit_2(tmp_path: Path):
    result = cli_extract(tmp_path / "no-model", write_data(tmp_path), tmp_path / "s")
    assert (
        result.exit_code == 2 and "no-model" in result.output and "no such folder" in result.output
    )


@pytest.fixture
def existing_store(qwen3_store: Path, tmp_path: Path) -> Path:
    """A private copy of the finished store, to try to damage."""
    return Path(shutil.copytree(qwen3_store, tmp_path / "existing"))


BAD_DATA = {
    "missing-file": None,
    "no-column": '{"prompt": "hi"}\n',
    "empty-conversation": '{"messages": []}\n',
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_exit_2_and_store_untouched(case, existing_store, tiny_qwen3, tmp_path):
    data = tmp_path / f"{case}.jsonl"
    if BAD_DATA[case] is not None:
        data.write_text(BAD_DATA[case])
    before = file_digests(existing_store)
    result = cli_extract(tiny_qwen3, data, existing_store, "target.tapped_layers=[0,1,3]")
    assert result.exit_code == 2 and "error:" in result.output
    assert str(data.name) in result.output or str(data) in result.output
    assert file_digests(existing_store) == before


def test_tokenizer_without_chat_template_exit_2(tiny_qwen3: Path, tmp_path: Path):
    model = Path(shutil.copytree(tiny_qwen3, tmp_path / "model"))
    (model / "chat_template.jinja").unlink()
    result = cli_extract(model, write_data(tmp_path), tmp_path / "s")
    assert result.exit_code == 2 and "chat_template" in result.output


@contextmanager
def kept_log_lines() -> Iterator[list[str]]:
    """The project logger's messages while the block runs (its handler writes to the stderr
    of the first test that set it up, which capture fixtures do not see)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, keep = logging.getLogger(LOGGER_NAME), Keep()
    logger.addHandler(keep)
    try:
        yield lines
    finally:
        logger.removeHandler(keep)


def test_store_of_another_target_or_config_is_refused(
    existing_store, tiny_qwen3, tiny_llama, tmp_path
):
    data, before = write_data(tmp_path), file_digests(existing_store)
    result = cli_extract(tiny_llama, data, existing_store, "target.tapped_layers=[0,1,3]")
    assert result.exit_code == 2 and "target" in result.output and "--overwrite" in result.output
    result = cli_extract(tiny_qwen3, data, existing_store, "target.tapped_layers=[0,1,2]")
    assert result.exit_code == 2 and "tapped_layers" in result.output
    assert file_digests(existing_store) == before
    # --overwrite replaces it (and the log says what the time before the first forward went to)
    with kept_log_lines() as lines:
        result = cli_extract(
            tiny_llama,
            data,
            existing_store,
            "target.tapped_layers=[0,1,3]",
            "store.overwrite=true",
            "data.max_samples=2",
        )
    assert result.exit_code == 0, result.output
    assert (
        open_store(existing_store, require_complete=True).attrs["target"]["model_type"] == "llama"
    )
    assert any(line.startswith("prepared 2 rows: 2 documents") for line in lines)
    assert any(line.startswith("rank 0: target loaded in") for line in lines)


def test_store_of_another_format_version_is_refused(existing_store, tiny_qwen3, tmp_path):
    meta = existing_store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["dflash"]["format_version"] = 99
    meta.write_text(json.dumps(doc))
    before = file_digests(existing_store)
    result = cli_extract(
        tiny_qwen3, write_data(tmp_path), existing_store, "target.tapped_layers=[0,1,3]"
    )
    assert result.exit_code == 2 and "format version 99" in result.output
    assert file_digests(existing_store) == before


BAD_SETTINGS = {
    "target.tapped_layers=[]": "tapped_layers is empty",
    "target.tapped_layers=[1,1]": "tapped_layers has duplicates",
    "verifier.topk=100000": "more than",
}


@pytest.mark.parametrize("setting", sorted(BAD_SETTINGS))
def test_bad_settings_exit_2_before_a_store_exists(setting, tiny_qwen3, tmp_path):
    result = cli_extract(tiny_qwen3, write_data(tmp_path), tmp_path / "s", setting)
    assert result.exit_code == 2 and BAD_SETTINGS[setting] in result.output, result.output
    assert not (tmp_path / "s").exists()


def test_out_that_is_a_file_exit_2(tiny_qwen3, tmp_path):
    (tmp_path / "s").write_text("not a store")
    result = cli_extract(tiny_qwen3, write_data(tmp_path), tmp_path / "s")
    assert result.exit_code == 2 and "is a file" in result.output
    assert (tmp_path / "s").read_text() == "not a store"


def _reverse_all_but_first_word(text: str) -> str:
    """Other tokens, same count: byte-level BPE tokenizes each space-led word alone."""
    first, *rest = text.split(" ")
    return " ".join([first, *reversed(rest)])


def test_changed_data_or_weights_under_the_same_settings_are_refused(tiny_qwen3, tmp_path):
    from common.tiny import build_tiny_target

    model = Path(shutil.copytree(tiny_qwen3, tmp_path / "model"))
    data, out = write_data(tmp_path), tmp_path / "store"
    settings = ("target.tapped_layers=[0,1,3]", "data.max_samples=3")
    assert cli_extract(model, data, out, *settings).exit_code == 0
    committed = file_digests(out)

    original = data.read_text()
    rows = [json.loads(line) for line in original.splitlines()]
    answer = rows[0]["messages"][1]
    answer["content"] = _reverse_all_but_first_word(answer["content"])
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = cli_extract(model, data, out, *settings)
    assert result.exit_code == 2, result.output
    assert "tokenized documents differ" in result.output and "--overwrite" in result.output

    data.write_text(original)
    build_tiny_target(model, seed=1)  # other weights in the same folder
    result = cli_extract(model, data, out, *settings)
    assert result.exit_code == 2 and "weights differ" in result.output, result.output
    assert file_digests(out) == committed


def test_store_from_before_fingerprints_still_resumes(existing_store, qwen3_store, tiny_qwen3):
    meta = existing_store / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["dflash"]["fingerprints"]
    meta.write_text(json.dumps(doc))
    data = qwen3_store.parent / "data.jsonl"  # the fixture's data: the same content key
    # its command from before the default became float8_e4m3fn: refused, with the way back
    result = cli_extract(tiny_qwen3, data, existing_store, "target.tapped_layers=[0,1,3]")
    message = " ".join(result.output.split())
    assert (
        result.exit_code == 2 and "(store.hidden_dtype ('bfloat16' -> 'nvfp4') differ)" in message
    ), message
    assert "to resume it, rerun with --set store.hidden_dtype=bfloat16" in message, message
    result = cli_extract(tiny_qwen3, data, existing_store, "target.tapped_layers=[0,1,3]", BF16)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("level", "shuffle"), [(1, True), (1, False), (0, True)])
def test_a_flipped_byte_in_a_shard_fails_to_decode(level, shuffle, tiny_qwen3, tmp_path):
    out = tmp_path / "store"
    extra = ("target.tapped_layers=[0,1,3]", "data.max_samples=2")
    run_extract(
        make_config(
            tiny_qwen3,
            write_data(tmp_path),
            out,
            *extra,
            f"store.compression_level={level}",
            f"store.byte_shuffle={str(shuffle).lower()}",
        )
    )
    hidden = out / "shards" / "shard-000000" / "hidden"
    zarr.open_array(hidden, mode="r")[...]  # intact: decodes
    (chunk_file,) = [p for p in (hidden / "c").rglob("*") if p.is_file()]
    data = bytearray(chunk_file.read_bytes())
    data[len(data) // 3] ^= 0x10  # inside a chunk's bytes (the shard index is at the end)
    chunk_file.write_bytes(bytes(data))
    with pytest.raises((RuntimeError, ValueError), match="checksum"):
        zarr.open_array(hidden, mode="r")[...]


def test_full_disk_is_a_clear_error_and_keeps_committed_shards(
    tiny_qwen3, tmp_path, monkeypatch, qwen3_store
):
    real_create = zarr.Group.create_array

    def create_array(self, name, **kwargs):
        if name == "hidden" and "shard-000002" in str(self.store_path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_create(self, name, **kwargs)

    monkeypatch.setattr(zarr.Group, "create_array", create_array)
    out, data = tmp_path / "store", write_data(tmp_path)
    result = cli_extract(
        tiny_qwen3, data, out, "target.tapped_layers=[0,1,3]", "run.writer_threads=1", BF16
    )
    assert result.exit_code == 2
    message = " ".join(result.output.split())  # click may wrap lines
    assert "disk full while writing shard 2" in message and str(out) in message
    assert "GiB free" in message and "rerun the same command" in message
    assert not list((out / "shards").glob(".tmp-*"))
    done = committed_shards(out)
    assert {0, 1} <= set(done) and 2 not in done and not open_store(out).complete
    # the committed shards are intact: equal to those of the uninterrupted store (same config)
    for index in done:
        for name, values in shard_arrays(qwen3_store, index).items():
            assert np.array_equal(values, shard_arrays(out, index)[name]), (index, name)


def test_shard_buffers_larger_than_host_memory_are_refused_up_front(
    tiny_qwen3, tmp_path, monkeypatch
):
    monkeypatch.setattr("stage1_extract.run.available_memory_bytes", lambda: 1 << 20)
    out = tmp_path / "store"
    result = cli_extract(tiny_qwen3, write_data(tmp_path), out, "store.sequences_per_shard=64")
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "GiB of host memory for shard buffers" in message
    assert "store.sequences_per_shard" in message and not out.exists()


def test_overwrite_never_deletes_a_folder_that_is_not_a_store(tiny_qwen3: Path, tmp_path: Path):
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    result = cli_extract(tiny_qwen3, write_data(tmp_path), folder, "store.overwrite=true")
    assert result.exit_code == 2 and "not a dflash store" in result.output
    assert (folder / "notes.txt").read_text() == "keep me"


def test_rerun_with_other_num_proc_resumes(qwen3_store: Path, tiny_qwen3: Path, tmp_path: Path):
    """data.num_proc changes only the speed of tokenizing: the same store, no refusal."""
    store = Path(shutil.copytree(qwen3_store, tmp_path / "copy"))
    before = file_digests(store)
    data = qwen3_store.parent / "data.jsonl"
    layers = "target.tapped_layers=[0,1,3]"
    result = cli_extract(tiny_qwen3, data, store, layers, "data.num_proc=2", BF16)
    assert result.exit_code == 0, result.output
    assert file_digests(store) == before


def test_reserved_or_mask_token_is_found(tiny_qwen3: Path) -> None:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from stage1_extract.job import reserved_token_id

    def added(*names: str) -> SimpleNamespace:
        vocab = {name: 50 + i for i, name in enumerate(names)}
        return SimpleNamespace(get_added_vocab=lambda: vocab)

    assert reserved_token_id(added("<|im_start|>", "<|im_end|>")) is None
    llama3 = added(
        "<|begin_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>"
    )
    assert reserved_token_id(llama3) == 51
    # a mask-named token (pystd-28m's <|mask|>, not declared as the mask token) comes first
    assert reserved_token_id(added("<|reserved_special_token_0|>", "<|MASK|>")) == 51
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    assert reserved_token_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|mask|>")


def _key_attrs(packing: dict, target: dict | None = None) -> dict:
    """Root attributes with what key_parts reads (a store's as extract writes them)."""
    return {
        "extract_config": {
            "data": {"path": "d.jsonl", "num_proc": 1},
            "target": target or {"dtype": "bfloat16"},
            "packing": packing,
            "store": {"chunk_tokens": 1024, "compression_level": 1},
        },
        "target": {"name_or_path": "m"},
        "tokenizer": {"name_or_path": "m"},
        "dataset": {"format": "text", "num_rows": 3},
        "tapped_layers": [1],
        "topk": 8,
        "full_logits": False,
        "sequences_per_shard": 4,
        "hidden_dtype": "bfloat16",
    }


def test_content_key_names_tf32_matmuls_only_when_on() -> None:
    """Stores written before target.matmul_precision existed resume (same key at highest);
    TF32 matmuls give other stored values, so another key."""
    from stage1_extract.store_root import content_key, key_parts

    packing = {"seq_len": 64, "overlong": "split"}

    def key(target: dict) -> str:
        return content_key(key_parts(_key_attrs(packing, target), "sha", {}))

    older = {"dtype": "float32"}
    assert key({**older, "matmul_precision": "highest"}) == key(older)
    assert key({**older, "matmul_precision": "high"}) != key(older)
    bf16 = {"dtype": "bfloat16"}  # no float32 matmuls: the same values, the same store
    assert key({**bf16, "matmul_precision": "high"}) == key(bf16)


def test_refusal_names_the_matmul_precision_and_how_to_resume() -> None:
    """An fp32 store written at highest (or before the option), rerun with TF32 on (as
    configs/pystd.yaml now asks): the refusal names the setting and the --set that resumes."""
    from stage1_extract.store_root import _explain_mismatch

    packing = {"seq_len": 64, "overlong": "split"}
    old = _key_attrs(packing, {"dtype": "float32"})
    new = _key_attrs(packing, {"dtype": "float32", "matmul_precision": "high"})
    for attrs in (old, new):
        attrs |= {
            "seq_len": 64,
            "dataset": {
                "path": "d",
                "split": "train",
                "name": None,
                "num_rows": 3,
                "format": "text",
            },
        }
        attrs["target"] |= {"revision": None, "config": {}}
    what, set_back = _explain_mismatch(old, new)
    assert what == "target.matmul_precision ('highest' -> 'high')"
    assert set_back == ["--set target.matmul_precision=highest"]


def test_refusal_names_changed_data_settings() -> None:
    """A rerun with only a data.* setting changed (data.on_invalid, data.format) is refused
    naming it, not blaming the document lengths; num_proc is not a reason."""
    from stage1_extract.store_root import _explain_mismatch

    packing = {"seq_len": 64, "overlong": "split"}
    old, new, faster = (_key_attrs(packing) for _ in range(3))
    for attrs in (old, new, faster):
        attrs["seq_len"] = 64
        attrs["dataset"] |= {"path": "d", "split": "train", "name": None}
        attrs["target"] |= {"revision": None, "config": {}}
    new["extract_config"]["data"]["on_invalid"] = "skip"
    assert _explain_mismatch(old, new)[0] == "data.on_invalid (unset -> 'skip')"
    new["dataset"]["format"] = "messages"
    assert _explain_mismatch(old, new)[0] == "dataset format, data.on_invalid (unset -> 'skip')"
    faster["extract_config"]["data"]["num_proc"] = 8
    assert "data." not in _explain_mismatch(old, faster)[0]


def test_content_key_of_next_fit_stores_is_unchanged_by_the_strategy_option() -> None:
    from stage1_extract.store_root import content_key, key_parts

    def key(packing: dict) -> str:
        return content_key(key_parts(_key_attrs(packing), "sha", {}))

    older = {"seq_len": 64, "overlong": "split"}  # written before packing.strategy existed
    assert key({**older, "strategy": "next_fit"}) == key(older)
    assert key({**older, "strategy": "best_fit"}) != key(older)


def _codec_names(array: zarr.Array) -> list[str]:
    """The chunk codecs inside the sharding codec, by name."""
    (sharding,) = array.metadata.codecs
    return [type(c).__name__ for c in sharding.codecs]


@pytest.mark.parametrize("shuffle", [True, False])
def test_byte_shuffle_codecs_and_identical_contents(shuffle, tiny_qwen3, tmp_path):
    """byte_shuffle changes how float arrays are compressed, never what reads back."""
    data = write_data(tmp_path)
    stores = {}
    for flag in (shuffle, not shuffle):
        out = tmp_path / f"store-{flag}"
        extra = ("target.tapped_layers=[0,1,3]", "data.max_samples=3", "target.dtype=float32")
        extra += (BF16,)  # bf16 hidden states: the 2-byte arrays byte shuffle applies to
        run_extract(
            make_config(tiny_qwen3, data, out, *extra, f"store.byte_shuffle={str(flag).lower()}")
        )
        stores[flag] = zarr.open_group(out / "shards" / "shard-000000", mode="r")
    group = stores[shuffle]
    for name in ("hidden", "topk_logits", "logsumexp"):
        codecs = _codec_names(group[name])
        if shuffle:
            assert codecs == ["BytesCodec", "BloscCodec", "Crc32cCodec"], (name, codecs)
            (blosc,) = [c for c in group[name].metadata.codecs[0].codecs if "Blosc" in str(c)]
            assert blosc.shuffle.value == "shuffle" and blosc.typesize == group[name].dtype.itemsize
        else:
            assert codecs == ["BytesCodec", "ZstdCodec"], (name, codecs)
    assert _codec_names(group["tokens"]) == ["BytesCodec", "ZstdCodec"]  # ints stay zstd
    other = stores[not shuffle]
    for name in group.array_keys():
        np.testing.assert_array_equal(group[name][...], other[name][...], err_msg=name)


def test_chunks_over_blosc_limit_stay_zstd() -> None:
    """Blosc refuses a buffer over ~2 GiB, which a chunk of full logits reaches (bf16, vocab
    152k, chunk_tokens 8192: 2.5 GB): such a chunk is zstd alone, as without byte shuffle."""
    from stage1_extract.writer import ShardLayout, chunk_codecs

    layout = ShardLayout(8192, 8192, 1, byte_shuffle=True)

    def names(chunk_tokens: int) -> list[str]:
        codecs = chunk_codecs("logits", 2, chunk_tokens * 152064 * 2, layout)
        return [type(c).__name__ for c in codecs]

    assert names(1024) == ["BloscCodec", "Crc32cCodec"]
    assert names(8192) == ["ZstdCodec"]


def test_padding_of_one_length_documents_is_named_before_extraction(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """Text rows of one length (what `dflash generate` writes) that seq_len is no multiple of:
    extract says how much would be padding and which seq_len packs them tight."""
    data = tmp_path / "rows.jsonl"
    data.write_text((json.dumps({"text": "one two three four five six seven eight"}) + "\n") * 12)
    with dflash_messages(logging.WARNING) as seen:
        run_extract(make_config(tiny_qwen3, data, tmp_path / "store", "packing.seq_len=64"))
    lines = [line for line in seen if "would be padding" in line]
    assert len(lines) == 1 and "100% of the documents are" in lines[0], seen
    assert "--set packing.seq_len=" in lines[0] and "would pad 0.0%" in lines[0]
