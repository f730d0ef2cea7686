"""`dflash inspect` and `dflash inspect verify` on hand-built stores (tests/inspect_fixtures.py).

The expected numbers are counted by hand from `DEFAULT_SEQUENCES`; every corruption must be
reported once, on the right shard and array, for the right reason.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
from click.testing import CliRunner, Result
from inspect_fixtures import DEFAULT_SEQUENCES, Doc, build_store

from common.inspect_verify import verify_store
from common.store import SHARD_ATTR, StoreError, open_store
from common.store_files import record_shard_files
from dflash_offline.cli import main

SHARD0 = "shard-000000"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, ["inspect", *map(str, args)])


@pytest.fixture(scope="module")
def built_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default fixture store, built once; tests get copies (`store`)."""
    return build_store(tmp_path_factory.mktemp("inspect") / "store").path


@pytest.fixture
def store(built_store: Path, tmp_path: Path) -> Path:
    """A copy of the default fixture store of this test's own (most tests damage theirs): the
    same files, modes and times, ~15 ms where building one took ~0.2 s."""
    return Path(shutil.copytree(built_store, tmp_path / "store", symlinks=True))


def test_summary_matches_hand_counts(store: Path) -> None:
    result = invoke(store, "--json")
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    assert s["complete"] is True
    assert s["shards"]["planned"] == 2 and s["shards"]["committed"] == 2
    assert s["shards"]["being_written"] == [".tmp-shard-000001-4242"]
    assert (s["sequences"], s["documents"], s["tokens"], s["loss_tokens"]) == (3, 5, 43, 34)
    assert s["padding_tokens"] == 5
    assert s["loss_share"] == pytest.approx(34 / 43)
    assert s["padding_share"] == pytest.approx(5 / 48)
    # Per token: tokens 4 + loss_mask 1 + position_ids 4 + document_ids 4 + hidden 2*8*2
    # + target_argmax 4 + topk_ids 4*4 + topk_logits 4*4 + logsumexp 4 = 85 bytes, 48 positions;
    # per document: 8 + 4 * 4 = 24 bytes, 5 documents.
    assert s["array_bytes_uncompressed"] == 85 * 48 + 24 * 5
    assert s["arrays"]["hidden"]["uncompressed"] == 3 * 16 * 2 * 8 * 2
    assert s["compression_ratio"] == pytest.approx(4200 / s["array_bytes_stored"])
    if shutil.which("du"):
        du = subprocess.run(["du", "-s", "-B1", str(store)], capture_output=True, text=True)
        assert s["bytes_on_disk"] == int(du.stdout.split()[0])
    assert s["bytes_per_token"] == pytest.approx(s["bytes_on_disk"] / 43)
    prov = s["provenance"]
    assert prov["target"] == {
        "name_or_path": "fixture/tiny-target",
        "revision": "abc123",
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "weights_sha256": None,  # the fixture records no fingerprints
        "dtype": "bfloat16",
        "matmul_precision": "highest",
    }
    assert prov["chat_template"] is True and prov["tapped_layers"] == [1, 3]
    assert (prov["seq_len"], prov["topk"], prov["dataset"]["num_rows"]) == (16, 4, 4)
    assert s["counts"]["split_documents"] == 1


def test_summary_table(store: Path) -> None:
    result = invoke(store)
    assert result.exit_code == 0, result.output
    lines = {line.split("  ")[0]: line for line in result.stdout.splitlines()}
    assert "complete: 2/2 shards committed, 1 being written" in lines["status"]
    assert lines["sequences"].endswith("3 x 16 tokens")
    assert "5 (4 source rows, 1 split" in lines["documents"]
    assert lines["tokens"].split()[-1] == "43"
    assert "34 (79.1% of tokens)" in lines["loss tokens"]
    assert "5 (10.4% of positions)" in lines["padding"]
    assert "fixture/tiny-target @ abc123" in lines["target"]
    assert "qwen3, 4 layers, run in bfloat16\n" in result.stdout  # no TF32 note at "highest"
    assert "chat template: yes" in lines["tokenizer"]


def test_target_named_by_weights_and_text_windows_by_their_length(store: Path) -> None:
    """A local target has no revision: the line read `pystd-28m @ ?`, as if something were
    missing, and a store of text windows showed `max 1024 new tokens per turn`, a
    sampling.max_new_tokens they never used (text.new_tokens sets their length)."""
    group = zarr.open_group(str(store), mode="r+")
    attrs = dict(group.attrs["dflash"])
    attrs["target"] = attrs["target"] | {"name_or_path": "/models/pystd", "revision": None}
    attrs["fingerprints"] = {"target_weights_sha256": "98aa08f6619e" + "0" * 52}
    window = {"prompt_tokens": 256, "new_tokens": 128, "stride": 1024}
    content = {
        "target": {"model": "/models/pystd", "weights_sha256": "98aa08f6619e" + "0" * 52},
        "backend": "local",
        "sampling": {"temperature": 0.0, "max_new_tokens": 1024},
        "text": window,
    }
    attrs["generation"] = {"content": content, "source": {"format": "text"}, "complete": True}
    group.attrs["dflash"] = attrs
    out = invoke(store).stdout
    assert "/models/pystd (weights 98aa08f6619e)\n" in out and "@" not in out
    assert "/models/pystd (local, weights 98aa08f6619e)\n" in out
    assert "greedy\n" in out and "per turn" not in out and "256 prompt + 128 new tokens" in out
    content["text"] = None  # chat rows: the limit applies to each rewritten turn
    content["target"] = {"model": "org/chat-model"}  # a hub id: no fingerprint
    group.attrs["dflash"] = attrs
    out = invoke(store).stdout
    assert "org/chat-model (local)\n" in out and "greedy, max 1024 new tokens per turn\n" in out


def test_in_progress_store(tmp_path: Path) -> None:
    path = build_store(tmp_path / "store", committed=[0]).path
    s = json.loads(invoke(path, "--json").stdout)
    assert s["complete"] is False and s["shards"]["committed"] == 1
    assert (s["sequences"], s["documents"], s["tokens"], s["loss_tokens"]) == (2, 3, 30, 21)
    assert "IN PROGRESS: 1/2 shards committed" in invoke(path).stdout
    result = invoke("verify", path)
    assert result.exit_code == 0, result.output
    assert "in progress: 1/2 shards committed" in result.stdout and "OK" in result.stdout


def loss_spans(docs: list[Doc]) -> list[list[int]]:
    return [ids for doc in docs for ids, loss in doc.segments if loss]


def test_sample_marks_loss_spans_with_token_ids(store: Path) -> None:
    result = invoke(store, "--sample", "3")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "could not be loaded" in out and "showing token ids" in out
    marked = [list(map(int, m.split())) for m in re.findall(r"⟦(.*?)⟧", out)]
    assert marked == [span for seq in DEFAULT_SEQUENCES for span in loss_spans(seq)]
    headers = re.findall(r"--- document (\d+): source row (\d+), piece (\d+)", out)
    assert headers == [
        ("0", "0", "0"),
        ("1", "1", "0"),
        ("2", "2", "0"),
        ("0", "2", "1"),
        ("1", "3", "0"),
    ]
    assert re.findall(r"padding: (\d+) tokens", out) == ["2", "3"]
    # Outside the marks: exactly the prompt tokens, in order.
    plain = re.sub(r"⟦.*?⟧", " ", out.split("=== sequence 0")[1])
    prompt_ids = [int(t) for t in re.findall(r"^[\d ]+$", plain, re.M) for t in t.split()]
    prompts = [
        t
        for seq in DEFAULT_SEQUENCES
        for d in seq
        for ids, loss in d.segments
        if not loss
        for t in ids
    ]
    assert prompt_ids == prompts


def test_sample_decodes_with_store_tokenizer(tmp_path: Path, tiny_qwen3: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = "<|im_start|>user\nWhat is a prime number?<|im_end|>\n<|im_start|>assistant\n"
    answer, text = "A prime number is a whole number.<|im_end|>", "Two, three, five and seven."
    seqs = [[Doc(0, [(enc(prompt), False), (enc(answer), True)]), Doc(1, [(enc(text), True)])]]
    seq_len = sum(len(ids) for d in seqs[0] for ids, _ in d.segments) + 4
    path = build_store(
        tmp_path / "store", seqs, seq_len=seq_len, vocab_size=len(tok), tokenizer=str(tiny_qwen3)
    ).path
    result = invoke(path, "--sample", "1")
    assert result.exit_code == 0, result.output
    assert re.findall(r"⟦(.*?)⟧", result.stdout, re.S) == [answer, text]
    assert prompt in result.stdout and "padding: 4 tokens" in result.stdout
    s = json.loads(invoke(path, "--sample", "1", "--json").stdout)
    spans = s["samples"][0]["documents"][0]["spans"]
    assert [(sp["loss"], sp["text"]) for sp in spans] == [(False, prompt), (True, answer)]
    assert s["sample_note"] is None
    assert verify_store(path)["ok"]


def test_verify_good_store(store: Path) -> None:
    result = invoke("verify", store)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("OK: 2 shards, 3 sequences, 43 tokens verified")
    report = json.loads(invoke("verify", store, "--json").stdout)
    assert report["ok"] is True and report["problems"] == []
    checked = {"sequences": 3, "documents": 5, "tokens": 43, "loss_tokens": 34, "padding_tokens": 5}
    assert report["checked"] == checked


def write(path: Path, index: tuple, value: int | float) -> None:
    array = zarr.open_array(str(path), mode="r+")
    array[index] = value


def set_shard_attr(shard: Path, key: str, delta: int) -> None:
    group = zarr.open_group(str(shard), mode="r+")
    attrs = dict(group.attrs[SHARD_ATTR])
    attrs[key] += delta
    group.attrs[SHARD_ATTR] = attrs


def retype_tokens(shard: Path) -> None:
    data = zarr.open_array(str(shard / "tokens"), mode="r")[:]
    shutil.rmtree(shard / "tokens")
    group = zarr.open_group(str(shard), mode="r+")
    group.create_array("tokens", data=data.astype(np.int64))


def tamper_root_count(store: Path) -> None:
    group = zarr.open_group(str(store), mode="r+")
    attrs = dict(group.attrs["dflash"])
    attrs["counts"] = attrs["counts"] | {"tokens": 44}
    group.attrs["dflash"] = attrs


S0 = Path("shards") / SHARD0
CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str, str, str]] = {
    "nan_hidden": (
        lambda s: write(s / S0 / "hidden", (1, 3, 1, 2), 0x7FC0),  # a bf16 quiet NaN
        SHARD0,
        "hidden",
        "1 NaN/Inf values (first at sequence 1, token 3)",
    ),
    "inf_logsumexp": (
        lambda s: write(s / S0 / "logsumexp", (0, 2), np.inf),
        SHARD0,
        "logsumexp",
        "1 NaN/Inf values (first at sequence 0, token 2)",
    ),
    "wrong_dtype": (
        lambda s: retype_tokens(s / S0),
        SHARD0,
        "tokens",
        "dtype int64, expected int32",
    ),
    "missing_array": (
        lambda s: shutil.rmtree(s / S0 / "topk_logits"),
        SHARD0,
        "topk_logits",
        "array missing",
    ),
    "count_mismatch": (
        lambda s: set_shard_attr(s / S0, "num_loss_tokens", 1),
        SHARD0,
        "attrs",
        "num_loss_tokens is 22 but loss_mask holds 21",
    ),
    "tampered_positions": (
        lambda s: write(s / S0 / "position_ids", (1, 3), 4),
        SHARD0,
        "position_ids",
        "1 positions not counting from 0 at their document start",
    ),
    "tampered_document_ids": (
        lambda s: write(s / S0 / "document_ids", (0, 9), 0),
        SHARD0,
        "document_ids",
        "1 tokens whose document id disagrees",
    ),
    "unsorted_topk": (
        lambda s: write(s / S0 / "topk_logits", (0, 0, 3), 1e6),
        SHARD0,
        "topk_logits",
        "1 tokens whose top-k is not sorted descending",
    ),
    "wrong_argmax": (
        lambda s: write(s / S0 / "target_argmax", (1, 0), -5),
        SHARD0,
        "target_argmax",
        "1 tokens whose argmax is not topk_ids[..., 0]",
    ),
    "missing_shard": (
        lambda s: shutil.rmtree(s / "shards" / "shard-000001"),
        "shard-000001",
        "-",
        "missing, yet the store is marked complete",
    ),
    "root_counts": (tamper_root_count, "store", "counts", "tokens is 44 but the shards hold 43"),
    "head_missing": (
        lambda s: (s / "target_head.safetensors").unlink(),
        "store",
        "target_head.safetensors",
        "file missing",
    ),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_verify_catches_corruption(store: Path, case: str) -> None:
    corrupt, shard, array, reason = CORRUPTIONS[case]
    corrupt(store)
    problems = verify_store(store)["problems"]
    assert len(problems) == 1, problems
    assert (problems[0]["shard"], problems[0]["array"]) == (shard, array)
    assert problems[0]["problem"].startswith(reason), problems[0]
    result = invoke("verify", store)
    assert result.exit_code == 1
    assert "FAILED: 1 problem\n" in result.stdout and reason in result.stdout


def test_verify_streams_in_small_chunks(tmp_path: Path) -> None:
    """Blocks of one sequence, and bf16 arrays in blocks of a few tokens, still find the fault."""
    path = build_store(tmp_path / "store", full_logits=True).path
    assert verify_store(path, chunk_bytes=300)["ok"]
    write(path / S0 / "logits", (1, 13, 40), 0xFF80)  # bf16 -inf, late in the shard
    write(path / S0 / "hidden", (1, 15, 0, 0), 0x7F80)  # bf16 +inf, in the last slab
    problems = verify_store(path, chunk_bytes=300)["problems"]
    assert {(p["array"], p["problem"]) for p in problems} == {
        ("logits", "1 NaN/Inf values (first at sequence 1, token 13)"),
        ("hidden", "1 NaN/Inf values (first at sequence 1, token 15)"),
    }


@pytest.mark.parametrize("command", [[], ["verify"]])
def test_other_format_version_is_rejected(tmp_path: Path, command: list[str]) -> None:
    path = build_store(tmp_path / "store", format_version=99).path
    result = invoke(*command, path)
    assert result.exit_code == 2
    assert "store format version 99 is not supported" in result.output
    assert "re-extract" in result.output


ROOT_DAMAGE: dict[str, tuple[Callable[[dict], object], str]] = {
    "missing_tapped_layers": (lambda a: a.pop("tapped_layers"), "tapped_layers missing"),
    "missing_target": (lambda a: a.pop("target"), "target missing"),  # verify said OK
    "missing_dataset": (lambda a: a.pop("dataset"), "dataset missing"),
    "text_hidden_size": (lambda a: a.update(hidden_size="8"), "hidden_size is '8', not int"),
}


@pytest.mark.parametrize("case", ROOT_DAMAGE)
def test_root_attributes_missing_or_of_another_type_are_refused(store: Path, case: str) -> None:
    """The summary raised KeyError (exit 1, 'a bug'), verify passed a store without `target` or
    `dataset`, and train met the KeyError after its checks; all now refuse it at open_store,
    naming the store, the attribute and the fix."""
    damage, what = ROOT_DAMAGE[case]
    group = zarr.open_group(str(store), mode="r+")
    attrs = dict(group.attrs["dflash"])
    damage(attrs)
    group.attrs["dflash"] = attrs
    for command in ([store], [store, "--sample", "1"], ["verify", store]):
        result = invoke(*command)
        assert result.exit_code == 2, result.output
        message = " ".join(result.output.split())
        assert f"error: {store}: root attributes {what}" in message and "re-extract" in message
    with pytest.raises(StoreError, match=what):
        open_store(store, require_complete=True)  # train's first check


def test_unknown_root_attributes_are_read(store: Path) -> None:
    group = zarr.open_group(str(store), mode="r+")
    group.attrs["dflash"] = dict(group.attrs["dflash"]) | {"added_later": {"x": 1}}
    assert invoke(store).exit_code == 0 and invoke("verify", store).exit_code == 0


@pytest.fixture(scope="module")
def extracted(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by `dflash extract` from the first example conversations."""
    from common.tiny import EXAMPLE_DATA

    folder = tmp_path_factory.mktemp("extracted")
    rows = [line for line in EXAMPLE_DATA.read_text().splitlines() if '"messages"' in line]
    (folder / "data.jsonl").write_text("\n".join(rows[:6]) + "\n")
    sets = ["packing.seq_len=64", "target.dtype=float32", "target.num_tapped=2"]
    sets += ["store.sequences_per_shard=4", "verifier.topk=8"]
    args = ["extract", "--devices", "cpu", "--model", str(tiny_qwen3)]
    args += ["--data", str(folder / "data.jsonl"), "--out", str(folder / "store")]
    result = CliRunner().invoke(main, [*args, *(a for s in sets for a in ("--set", s))])
    assert result.exit_code == 0, result.output
    return folder / "store"


def test_real_store_summary_verify_and_sample(extracted: Path, tiny_qwen3: Path) -> None:
    s = json.loads(invoke(extracted, "--json", "--sample", "2").stdout)
    counts = s["counts"]
    for key in ("sequences", "documents", "tokens", "loss_tokens", "padding_tokens"):
        assert s[key] == counts[key], key
    assert s["shards"]["committed"] == s["shards"]["planned"] and s["complete"]
    assert s["provenance"]["tokenizer"] == str(tiny_qwen3) and s["provenance"]["seq_len"] == 64
    # The marked spans are exactly the runs of loss_mask == 1 of the stored arrays.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    group = zarr.open_group(str(extracted / "shards" / SHARD0), mode="r")
    tokens, loss, docs = group["tokens"][:2], group["loss_mask"][:2], group["document_ids"][:2]
    expected = []
    for row in range(2):
        for doc in np.unique(docs[row][docs[row] >= 0]):
            keep = (docs[row] == doc) & (loss[row] == 1)
            starts = np.flatnonzero(keep & ~np.r_[False, keep[:-1]])
            stops = np.flatnonzero(keep & ~np.r_[keep[1:], False]) + 1
            expected += [tok.decode(tokens[row][a:b]) for a, b in zip(starts, stops, strict=True)]
    out = invoke(extracted, "--sample", "2").stdout
    assert re.findall(r"⟦(.*?)⟧", out, re.S) == expected and expected
    assert "<|im_start|>assistant\n⟦" in out  # the prompt is shown, outside the marks
    result = invoke("verify", extracted)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith("OK:")


def test_real_store_tampering_is_caught(extracted: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(extracted, tmp_path / "store"))
    # the default nvfp4 rows of hidden size 64: 32 bytes of codes, then 4 e4m3 block scales;
    # 0x7F is e4m3's NaN, here the second block's scale
    write(copy / S0 / "hidden", (0, 1, 1, 33), 0x7F)
    write(copy / S0 / "position_ids", (0, 2), 9)
    problems = {(p["array"], p["problem"]) for p in verify_store(copy)["problems"]}
    assert problems == {
        ("hidden", "1 NaN/Inf values (first at sequence 0, token 1)"),
        (
            "position_ids",
            "1 positions not counting from 0 at their document start (or not 0 on padding) "
            "(first at sequence 0, token 2)",
        ),
    }


def test_sample_on_a_terminal_uses_color_not_brackets(store: Path) -> None:
    from common.inspect_store import render_samples, sample_sequences
    from common.store import open_store

    samples, note, _ = sample_sequences(open_store(store), 1)
    out = render_samples(samples, note, color=True)
    assert "⟦" not in out
    assert re.findall(r"\x1b\[32m(.*?)\x1b\[0m", out) == ["9 10 11 12 13", "17 18"]


def test_unreadable_shard_is_reported_not_fatal(store: Path) -> None:
    (store / S0 / "zarr.json").write_text("{ broken")
    result = invoke(store)
    assert result.exit_code == 0, result.output
    assert "UNREADABLE: shard-000000" in result.stdout
    problems = verify_store(store)["problems"]
    assert [(p["shard"], p["array"]) for p in problems] == [(SHARD0, "-")]
    assert problems[0]["problem"].startswith("group unreadable")


def test_summary_names_missing_and_unplanned_shards(store: Path) -> None:
    """A complete store whose shard folder is gone read 'complete: 1/2 shards committed' and
    nothing else; a shard folder outside the plan was counted without a word."""
    shutil.rmtree(store / "shards" / "shard-000001")
    shutil.copytree(store / S0, store / "shards" / "shard-000005")
    result = invoke(store)
    assert result.exit_code == 0, result.output
    assert (
        "complete: 2/2 shards committed, 1 being written (ignored); MISSING: shard-000001; "
        "NOT IN THE PLAN: shard-000005 (run `dflash inspect verify`)"
    ) in result.stdout
    shards = json.loads(invoke(store, "--json").stdout)["shards"]
    assert (shards["missing"], shards["outside_plan"]) == (["shard-000001"], ["shard-000005"])
    assert json.loads(invoke("verify", store, "--json").stdout)["ok"] is False


def truncate(path: Path, size: int = 100) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def test_damaged_chunk_is_reported_and_other_shards_still_checked(store: Path) -> None:
    """A chunk whose bytes no longer decode names its shard and array, and the fix; the other
    shard is still checked (its NaN is found) and verify exits 1, not with an error."""
    truncate(store / S0 / "hidden" / "c" / "0" / "0" / "0" / "0")
    write(store / "shards" / "shard-000001" / "logsumexp", (0, 2), np.inf)
    problems = verify_store(store)["problems"]
    assert [(p["shard"], p["array"]) for p in problems] == [
        (SHARD0, "hidden"),
        ("shard-000001", "logsumexp"),
    ]
    assert problems[0]["problem"].startswith("cannot decode (ValueError: Stored and computed")
    assert "delete the shard folder and rerun the same `dflash extract`" in problems[0]["problem"]
    result = invoke("verify", store)
    assert result.exit_code == 1, result.output
    assert re.search(rf"{SHARD0}\s+hidden\s+cannot decode", result.stdout)
    report = json.loads(invoke("verify", store, "--json").stdout)
    assert report["ok"] is False and report["problems"] == problems


def test_damaged_array_metadata_is_reported(store: Path) -> None:
    (store / S0 / "hidden" / "zarr.json").write_text("{ broken")
    problems = verify_store(store)["problems"]
    assert [(p["shard"], p["array"]) for p in problems] == [(SHARD0, "hidden")]
    assert problems[0]["problem"].startswith("metadata unreadable (JSONDecodeError")
    assert "re-extract" in problems[0]["problem"]
    assert invoke("verify", store).exit_code == 1


def test_verify_after_the_store_names_the_right_order(store: Path) -> None:
    result = invoke(store, "verify")
    assert result.exit_code == 2
    assert f"dflash inspect verify {store}" in result.output
    help_text = invoke("--help").output
    assert "dflash inspect verify STORE" in help_text and "dflash inspect STORE" in help_text


def test_empty_or_missing_data_file_is_reported(store: Path) -> None:
    """zarr reads an empty or absent shard file as zeros without an error: verify must not."""
    truncate(store / S0 / "hidden" / "c" / "0" / "0" / "0" / "0", 0)
    shutil.rmtree(store / "shards" / "shard-000001" / "tokens" / "c")
    problems = verify_store(store)["problems"]
    found = {(p["shard"], p["array"]): p["problem"] for p in problems}
    assert found[(SHARD0, "hidden")].startswith(
        "empty data file c/0/0/0/0 (it would read as zeros)"
    )
    assert found[("shard-000001", "tokens")].startswith("no data file")
    assert all("re-extract" in problem for problem in found.values())
    assert invoke("verify", store).exit_code == 1


def test_tf32_note_only_for_float32_targets_that_ran_it() -> None:
    from common.inspect_store import _tf32

    assert _tf32({"dtype": "float32", "matmul_precision": "high"}) == " (TF32 matmuls)"
    assert _tf32({"dtype": "float32", "matmul_precision": "highest"}) == ""
    assert _tf32({"dtype": "bfloat16", "matmul_precision": "high"}) == ""  # bf16 matmuls anyway
    assert _tf32({"dtype": "float32"}) == ""  # stores from before the option


def zero_tail(path: Path) -> None:
    """Overwrite the file's last bytes (its shard index and checksum) keeping its size."""
    with path.open("r+b") as f:
        f.seek(-8, 2)
        f.write(bytes(8))


def rewrite_array(shard: Path, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Replace one array of a shard, its file sizes recorded again (a foreign or buggy writer)."""
    data = change(zarr.open_array(str(shard / name), mode="r")[:])
    shutil.rmtree(shard / name)
    zarr.open_group(str(shard), mode="r+").create_array(name, data=data)
    record_shard_files(shard)


SAMPLE_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    # zarr raised a bare ValueError (the checksum) naming no shard; the recorded size finds it
    "truncated_chunk": (
        lambda s: truncate(s / S0 / "tokens" / "c" / "0" / "0"),
        "tokens: file tokens/c/0/0 is 100 bytes",
    ),
    "overwritten_chunk": (
        lambda s: zero_tail(s / S0 / "tokens" / "c" / "0" / "0"),
        "cannot decode",
    ),
    # zarr reads a missing data file as zeros: the sample showed token 0 everywhere
    "deleted_chunk": (lambda s: (s / S0 / "loss_mask" / "c" / "0" / "0").unlink(), "missing"),
    "broken_metadata": (
        lambda s: (s / S0 / "document_ids" / "zarr.json").write_text("{ broken"),
        "metadata unreadable",
    ),
    # IndexError (exit 1, 'a bug'), or other values shown as the sample
    "short_loss_mask": (
        lambda s: rewrite_array(s / S0, "loss_mask", lambda a: a[:, :-2]),
        "loss_mask: shape (2, 14), expected (2, 16)",
    ),
    "short_doc_piece": (
        lambda s: rewrite_array(s / S0, "doc_piece", lambda a: a[:-1]),
        "doc_piece: shape (2,), expected (3,)",
    ),
    "float_tokens": (
        lambda s: rewrite_array(s / S0, "tokens", lambda a: a.astype(np.float32)),
        "tokens: dtype float32, expected int32",
    ),
}


@pytest.mark.parametrize("case", SAMPLE_DAMAGE)
def test_sample_skips_a_damaged_shard_naming_it_and_verify(store: Path, case: str) -> None:
    """--sample on a store with a damaged shard: the shard is skipped with a warning that names
    its folder and `dflash inspect verify`, the other shards are still sampled, and the
    tokenizer note keeps its meaning (it is about the tokenizer alone)."""
    damage, what = SAMPLE_DAMAGE[case]
    damage(store)
    result = invoke(store, "--sample", "3")
    assert result.exit_code == 0, result.output
    out = result.stdout
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert f"{SHARD0} ({store / S0})" in warning and what in warning
    assert f"run `dflash inspect verify {store}`" in warning
    assert re.findall(r"=== sequence (\d+) \(shard (\d+)\)", out) == [("2", "1")]
    assert re.findall(r"⟦(.*?)⟧", out) == ["41 42 43 44 45 46", "47 48 49 50 51 52 53"]
    s = json.loads(invoke(store, "--sample", "3", "--json").stdout)
    assert [sample["sequence"] for sample in s["samples"]] == [2]
    assert s["sample_note"].startswith("tokenizer 'fixture/no-such-tokenizer' could not be")
    [skipped] = s["sample_skipped"]
    assert (skipped["shard"], skipped["path"]) == (SHARD0, str(store / S0))
    assert what in skipped["problem"]


def test_sample_of_a_sound_store_skips_nothing(store: Path) -> None:
    s = json.loads(invoke(store, "--sample", "3", "--json").stdout)
    assert [sample["sequence"] for sample in s["samples"]] == [0, 1, 2]
    assert s["sample_skipped"] == []
    assert "warning:" not in invoke(store, "--sample", "3").stdout
