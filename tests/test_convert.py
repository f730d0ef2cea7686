"""`dflash convert`: a store to HDF5 and back to its arrays and attributes (every one), shard and
array selection, an HDF5 file in the documented input layout imported into a store that passes
`inspect verify` and trains, and bad inputs (one `error:` line, exit 2)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from safetensors import safe_open
from store_factory import FactorySpec, build_store
from test_extract import make_config, write_data

from common.config import build_config
from common.inspect_verify import verify_store
from common.store import (
    HEAD_FILE,
    SHARD_ATTR,
    bits_to_bf16,
    committed_shards,
    dequantize_fp8,
    open_store,
    shard_name,
    shards_dir,
)
from dflash_offline.cli import main as cli
from stage1_extract.run import run_extract
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
VERIFIER = ("target_argmax", "topk_ids", "topk_logits", "logsumexp")


def convert(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["convert", *map(str, args)])
    return result.exit_code, result.output


def shard(store: Path, index: int) -> zarr.Group:
    return zarr.open_group(shards_dir(store) / shard_name(index), mode="r")


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = FactorySpec(num_sequences=12, sequences_per_shard=5, hidden_dtype="float8_e4m3fn")
    return build_store(tmp_path_factory.mktemp("fp8") / "store", spec)


@pytest.fixture(scope="module")
def extracted(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real store of the tiny target; next-fit, so its documents in order re-pack the same,
    and the last layer (3) tapped, so the verifier can be recomputed from the head."""
    folder = tmp_path_factory.mktemp("convert")
    cfg = make_config(
        tiny_qwen3,
        write_data(folder),
        folder / "store",
        "target.tapped_layers=[0,1,3]",
        "packing.strategy=next_fit",
        "store.hidden_dtype=bfloat16",  # exact round trips (fp8: the fp8_store fixture)
    )
    run_extract(cfg)
    return folder / "store"


def check_export(store: Path, h5: Path, shards: list[int], names: list[str] | None = None) -> None:
    """Every array of the listed shards equals the file's rows; every attribute is there."""
    info = open_store(store)
    with h5py.File(h5, "r") as f:
        assert json.loads(f.attrs["dflash"]) == info.attrs
        assert f.attrs["seq_len"] == info.seq_len
        assert list(f.attrs["tapped_layers"]) == info.tapped_layers
        assert list(f["index/shards"][...]) == shards
        seq_off, doc_off = f["index/sequence_offsets"][...], f["index/document_offsets"][...]
        for pos, index in enumerate(shards):
            group = shard(store, index)
            meta = json.loads(f["index/shard_attrs"][pos])
            assert meta == dict(group.attrs[SHARD_ATTR])
            for name, array in group.arrays():
                if names is not None and name not in names:
                    assert name not in f
                    continue
                lo, hi = (doc_off if name.startswith("doc_") else seq_off)[pos : pos + 2]
                stored = f[name][lo:hi]
                assert stored.dtype == array.dtype and np.array_equal(stored, array[...]), name
        if names is None or "target_head" in names:
            with safe_open(str(store / HEAD_FILE), framework="pt") as head:
                assert json.loads(f["target_head"].attrs["metadata"]) == head.metadata()
                for key in head.keys():  # noqa: SIM118
                    bits = f["target_head"][key]
                    assert bits.attrs["encoding"] == "bfloat16-bits"
                    assert torch.equal(bits_to_bf16(bits[...]), head.get_tensor(key))


def test_round_trip_every_array_and_attribute(extracted: Path, tmp_path: Path) -> None:
    code, out = convert(extracted, tmp_path / "all.h5")
    assert code == 0, out
    check_export(extracted, tmp_path / "all.h5", committed_shards(extracted))
    with h5py.File(tmp_path / "all.h5", "r") as f:
        assert f["hidden"].attrs["encoding"] == "bfloat16-bits"
        assert f["hidden"].compression == "gzip" and f["hidden"].chunks is not None


def test_fp8_keeps_scales_and_decodes_on_request(fp8_store: Path, tmp_path: Path) -> None:
    code, out = convert(fp8_store, tmp_path / "bits.h5", "--compression", "lzf")
    assert code == 0, out
    check_export(fp8_store, tmp_path / "bits.h5", [0, 1, 2])
    with h5py.File(tmp_path / "bits.h5", "r") as f:
        assert f["hidden"].attrs["encoding"] == "float8_e4m3fn-bits"
        assert f["tokens"].compression == "lzf"
        bits, scale = torch.from_numpy(f["hidden"][...]), torch.from_numpy(f["hidden_scale"][...])
    code, out = convert(fp8_store, tmp_path / "f32.h5", "--hidden-as", "float32")
    assert code == 0, out
    with h5py.File(tmp_path / "f32.h5", "r") as f:
        assert "hidden_scale" not in f and f["hidden"].dtype == np.float32
        assert torch.equal(torch.from_numpy(f["hidden"][...]), dequantize_fp8(bits, scale))
        assert f["target_head/lm_head.weight"].dtype == np.float32


def test_existing_out_is_refused_without_overwrite(fp8_store: Path, tmp_path: Path) -> None:
    """An existing OUT.h5 is not silently replaced (extract and generate refuse too), and a
    folder as OUT is named as such, not a raw 'Is a directory' on a temporary file."""
    out = tmp_path / "store.h5"
    out.write_bytes(b"precious")
    code, text = convert(fp8_store, out, "--arrays", "tokens")
    assert code == 2 and text.startswith("error:") and "--overwrite" in text, text
    assert out.read_bytes() == b"precious"
    code, text = convert(fp8_store, out, "--arrays", "tokens", "--overwrite")
    assert code == 0 and h5py.is_hdf5(out), text
    code, text = convert(fp8_store, tmp_path, "--arrays", "tokens")
    assert code == 2 and "is a folder" in text and len(text.strip().splitlines()) == 1, text


def test_a_deleted_chunk_file_is_refused_not_exported_as_zeros(
    fp8_store: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(fp8_store, store)
    (shards_dir(store) / shard_name(1) / "tokens" / "c" / "0" / "0").unlink()
    code, text = convert(store, tmp_path / "out.h5")
    assert code == 2 and "shard-000001 array tokens" in text and "missing" in text, text
    assert not (tmp_path / "out.h5").exists()
    code, text = convert(store, tmp_path / "out.h5", "--shards", "0,2")  # the others are whole
    assert code == 0, text


def test_a_flipped_byte_is_one_line_naming_shard_and_array(fp8_store: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(fp8_store, store)
    chunk = next((shards_dir(store) / shard_name(2) / "tokens" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only decoding finds it
    chunk.write_bytes(bytes(data))
    code, text = convert(store, tmp_path / "out.h5")
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert "shard-000002 array tokens cannot be decoded" in text and "rerun" in text, text
    assert not (tmp_path / "out.h5").exists()


def test_disk_full_is_one_line_naming_the_file_then_a_rerun_writes_it(
    fp8_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h5py reports a failed write as a RuntimeError whose text holds the errno (injected
    here: a real one also leaves HDF5's library state behind in this process)."""
    from dflash_offline.convert import to_hdf5

    real = to_hdf5._copy_shard

    def full(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "Can't write data (file write failed: errno = 28, error message = "
            "'No space left on device')"
        )

    monkeypatch.setattr(to_hdf5, "_copy_shard", full)
    out = tmp_path / "out.h5"
    code, text = convert(fp8_store, out)
    assert code == 2 and len(text.strip().splitlines()) == 1, text
    assert f"no space left writing the HDF5 file {out}" in text and "needs about" in text, text
    assert list(tmp_path.iterdir()) == []  # no half file, no temporary left
    monkeypatch.setattr(to_hdf5, "_copy_shard", real)
    code, text = convert(fp8_store, out)
    assert code == 0, text


def test_shard_and_array_selection(extracted: Path, tmp_path: Path) -> None:
    out = tmp_path / "some.h5"
    code, text = convert(
        extracted,
        out,
        "--shards",
        "0,2-3",
        "--arrays",
        "tokens,hidden,doc_length",
        "--compression",
        "none",
    )
    assert code == 0, text
    check_export(extracted, out, [0, 2, 3], ["tokens", "hidden", "doc_length"])
    with h5py.File(out, "r") as f:
        assert set(f) == {"tokens", "hidden", "doc_length", "index"}
        assert f["tokens"].compression is None
    for args, words in [
        (["--shards", "99"], "no committed shards [99]"),
        (["--shards", "a-b"], "is not a shard number"),
        (["--arrays", "tokens,nope"], "has no array nope"),
        (["--seq-len", "64"], "--seq-len apply only to an import"),
    ]:
        code, text = convert(extracted, tmp_path / "bad.h5", *args)
        assert code == 2 and text.startswith("error:") and words in text, text
    assert not (tmp_path / "bad.h5").exists()


def write_input(
    store: Path, path: Path, *, verifier: bool, layers: list[int] | None = None, head: bool = False
) -> dict[str, np.ndarray]:
    """The input layout built by hand from a store's documents, in packing order; `layers`
    picks tapped layers; `head` adds /target_head and the target's config."""
    info = open_store(store)
    keep = [info.tapped_layers.index(i) for i in (layers or info.tapped_layers)]
    parts: dict[str, list[np.ndarray]] = {}
    for index in committed_shards(store):
        group = shard(store, index)
        docs = {k: group[k][...] for k in ("doc_sequence", "doc_start", "doc_length")}
        names = ["tokens", "loss_mask", "hidden", *(VERIFIER if verifier else ())]
        arrays = {k: group[k][...] for k in names}
        for seq, start, length in zip(*docs.values(), strict=True):
            for name, array in arrays.items():
                parts.setdefault(name, []).append(array[seq, start : start + length])
        parts.setdefault("doc_lengths", []).append(docs["doc_length"].astype(np.int64))
        parts.setdefault("doc_source_index", []).append(group["doc_source_index"][...])
    flat = {name: np.concatenate(p) for name, p in parts.items()}
    # pieces of one split document are consecutive (next-fit): join them into the document
    source = flat.pop("doc_source_index")
    first = np.flatnonzero(np.r_[True, source[1:] != source[:-1]])
    flat["doc_lengths"] = np.add.reduceat(flat["doc_lengths"], first)
    flat["doc_source_index"] = source[first]
    flat["hidden"] = flat["hidden"][:, keep]
    with h5py.File(path, "w") as f:
        for name, data in flat.items():
            f[name] = data
        f["hidden"].attrs["tapped_layers"] = layers or info.tapped_layers
        f["hidden"].attrs["encoding"] = "bfloat16-bits"
        if head:
            with safe_open(str(store / HEAD_FILE), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118
                    f[f"target_head/{key}"] = h.get_tensor(key).float().numpy()
            f.attrs["target_config"] = json.dumps(info.attrs["target"]["config"])
            f.attrs["rms_norm_eps"] = 1e-6
            tok = info.attrs["tokenizer"]
            f.attrs["pad_token_id"] = tok["pad_token_id"]
            # train's mask token needs a real embedding row: the pad row of the tiny one is zero
            f.attrs["mask_token_id"] = tok["mask_token_id"] or tok["reserved_token_id"]
    return flat


def import_store(h5: Path, out: Path, *extra: str) -> Path:
    code, text = convert(
        h5, out, "--seq-len", "64", "--sequences-per-shard", "2", "--packing", "next_fit", *extra
    )
    assert code == 0, text
    report = verify_store(out)
    assert report["ok"], report["problems"]
    return out


def train_steps(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false", "optim.max_steps=3"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, "data.holdout_sequences=1", *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_import_with_verifier_outputs_rebuilds_the_store(
    extracted: Path, tiny_qwen3: Path, tmp_path: Path
) -> None:
    write_input(extracted, tmp_path / "in.h5", verifier=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store", "--target", tiny_qwen3)
    info, original = open_store(store), open_store(extracted)
    assert info.attrs["converted_from"]["verifier"] == "input"
    assert info.attrs["counts"] == original.attrs["counts"]
    shown = CliRunner().invoke(cli, ["inspect", str(store)])
    assert shown.exit_code == 0, shown.output
    assert "run in" not in shown.output  # no target ran here: no dtype to show
    assert committed_shards(store) == committed_shards(extracted)
    for index in committed_shards(store):
        mine, theirs = shard(store, index), shard(extracted, index)
        for name, array in theirs.arrays():
            assert np.array_equal(mine[name][...], array[...]), (index, name)
    rows = train_steps(store, tmp_path / "run")
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)


def test_import_compresses_like_extract(extracted: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    """The import writes the codecs its recorded extract_config names: byte shuffle (the
    default) for the float arrays, as `dflash extract` does."""
    write_input(extracted, tmp_path / "in.h5", verifier=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store", "--target", tiny_qwen3)
    assert open_store(store).attrs["extract_config"]["store"]["byte_shuffle"] is True

    def codecs(group: zarr.Group, name: str) -> list[str]:
        (sharding,) = group[name].metadata.codecs
        return [type(c).__name__ for c in sharding.codecs]

    mine, theirs = shard(store, 0), shard(extracted, 0)
    for name in ("hidden", "topk_logits", "logsumexp", "tokens"):
        assert codecs(mine, name) == codecs(theirs, name), name
    assert "BloscCodec" in codecs(mine, "hidden")


def test_import_computes_the_verifier_from_the_head(extracted: Path, tmp_path: Path) -> None:
    """No verifier outputs, last layer tapped: argmax and top-k from the LM head, from the
    file's /target_head and target_config (no target folder)."""
    write_input(extracted, tmp_path / "in.h5", verifier=False, head=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store", "--topk", "8")
    info = open_store(store)
    assert info.attrs["converted_from"]["verifier"] == "head" and info.topk == 8
    same = total = 0
    for index in committed_shards(store):
        mine, theirs = shard(store, index), shard(extracted, index)
        real = theirs["document_ids"][...] >= 0
        same += int((mine["target_argmax"][...] == theirs["target_argmax"][...])[real].sum())
        total += int(real.sum())
    # the file's hidden states are the store's bf16 copies, the store's argmax came from fp32
    assert same / total > 0.95


def test_import_without_verifier_trains_on_the_data_fp8(extracted: Path, tmp_path: Path) -> None:
    flat = write_input(extracted, tmp_path / "in.h5", verifier=False, layers=[0, 1], head=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store", "--hidden-dtype", "float8_e4m3fn")
    info = open_store(store)
    assert info.attrs["converted_from"]["verifier"] == "data" and info.topk == 1
    assert info.hidden_dtype == "float8_e4m3fn"
    assert info.tapped_layers == [0, 1]
    group = shard(store, 0)
    docs = {k: group[k][...] for k in ("doc_sequence", "doc_start", "doc_length")}
    seq, start, length = (int(v[0]) for v in docs.values())
    argmax = group["target_argmax"][seq, start : start + length]
    assert np.array_equal(argmax[:-1], flat["tokens"][1:length])
    rows = train_steps(store, tmp_path / "run", "loss.target=data")
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)


def test_import_resumes_and_refuses_another_file(extracted: Path, tmp_path: Path) -> None:
    write_input(extracted, tmp_path / "in.h5", verifier=False, head=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store")
    first = (shards_dir(store) / shard_name(1) / "tokens" / "c" / "0" / "0").stat().st_mtime_ns
    import shutil

    shutil.rmtree(shards_dir(store) / shard_name(0))
    import_store(tmp_path / "in.h5", store)  # rebuilds only the missing shard
    assert (
        shards_dir(store) / shard_name(1) / "tokens" / "c" / "0" / "0"
    ).stat().st_mtime_ns == first
    code, text = convert(tmp_path / "in.h5", store, "--seq-len", "32")
    assert code == 2 and "--overwrite" in text, text


def test_a_resumed_import_is_not_told_it_predates_fingerprints(
    extracted: Path, tmp_path: Path
) -> None:
    """An import records no fingerprints (its key names the file's size and modification
    time): its resume logged 'store ... predates content fingerprints' of a store it wrote
    itself. An extract store from before fingerprints is still told."""
    from log_capture import dflash_messages

    from stage1_extract.store_root import check_fingerprints, write_root_attrs

    write_input(extracted, tmp_path / "in.h5", verifier=False, head=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store")
    attrs = open_store(store).attrs
    assert "fingerprints" not in attrs
    # what an import killed after its first shard leaves
    write_root_attrs(store, {k: v for k, v in attrs.items() if k != "counts"} | {"complete": False})
    for index in committed_shards(store)[1:]:
        shutil.rmtree(shards_dir(store) / shard_name(index))
    with dflash_messages(logging.INFO) as logged:
        import_store(tmp_path / "in.h5", store)
    assert any(line.startswith(f"resuming {store}: 1/") for line in logged), logged
    assert not [line for line in logged if "fingerprints" in line], logged
    current = {"fingerprints": {"documents_sha256": "d", "target_weights_sha256": None}}
    with dflash_messages(logging.INFO) as logged:
        check_fingerprints(store, attrs, current)
    assert logged == [
        f"store {store} predates content fingerprints: the data and weights are not checked"
    ]


def bad_file(path: Path, tokens: int = 10, **datasets: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        f["tokens"] = np.arange(tokens, dtype=np.int32)
        for name, data in datasets.items():
            f[name] = data
    return path


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", "does not exist"),
        ("not_hdf5", "not a readable HDF5 file"),
        ("no_hidden", "dataset /hidden is missing"),
        ("no_bounds", "add /doc_lengths"),
        ("lengths_sum", "sum to 9 but /tokens holds 10"),
        ("hidden_rows", "/hidden has shape (8, 2, 4)"),
        ("no_layers", "no attribute tapped_layers"),
        ("partial_verifier", "give all four"),
        ("no_target", "no target: pass --target"),
        ("unmarked_bits", "/hidden is uint16: give float32/float16, or bf16 bits"),
        ("int_hidden", "/hidden is int32"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(case: str, words: str, tmp_path: Path) -> None:
    hidden = np.zeros((10, 2, 4), np.float32)
    path = tmp_path / "in.h5"
    if case == "missing":
        pass
    elif case == "not_hdf5":
        path.write_text("tokens,hidden\n")
    elif case == "no_hidden":
        bad_file(path, doc_lengths=np.array([10]))
    elif case == "no_bounds":
        bad_file(path, hidden=hidden)
    elif case == "lengths_sum":
        bad_file(path, hidden=hidden, doc_lengths=np.array([4, 5]))
    elif case == "hidden_rows":
        bad_file(path, hidden=hidden[:8], doc_lengths=np.array([10]))
    elif case in ("unmarked_bits", "int_hidden"):  # bf16 bits without encoding="bfloat16-bits"
        dtype = np.uint16 if case == "unmarked_bits" else np.int32
        bad_file(path, hidden=hidden.astype(dtype), doc_lengths=np.array([10]))
    else:
        extra = {"target_argmax": np.zeros(10, np.int32)} if case == "partial_verifier" else {}
        bad_file(path, hidden=hidden, doc_offsets=np.array([0, 4]), **extra)
    if path.is_file() and case not in ("no_layers", "not_hdf5"):
        with h5py.File(path, "a") as f:
            if "hidden" in f:
                f["hidden"].attrs["tapped_layers"] = [0, 1]
    code, text = convert(path, tmp_path / "store")
    assert code == 2 and text.startswith("error:") and len(text.strip().splitlines()) == 1, text
    assert words in text and str(path) in text, text
    assert not (tmp_path / "store").exists()
