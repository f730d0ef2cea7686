"""A damaged store never trains silently, two writers never share one, and a full disk leaves
it resumable: the file sizes recorded at commit (FORMAT.md v2), checked before step 1 and after
every read; one error line per damaged sequence, or `data.on_damaged=skip`; the writer lock;
out-of-space errors during shard writes; `inspect verify` over every array."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from store_factory import _array as factory_array
from store_factory import build_store as build_factory_store
from test_extract import DEBUG, cli_extract, make_config, write_data
from test_extract_resume import LAYERS, REPO, assert_same_store
from zarr.storage import LocalStore

from common.config import build_config
from common.inspect_verify import verify_store
from common.store import (
    FILES_KEY,
    REEXTRACT,
    SHARD_ATTR,
    StoreError,
    StoreInfo,
    committed_shards,
    open_store,
)
from common.store_check import check_shards
from common.store_files import record_shard_files, recorded_files
from stage1_extract.run import run_extract
from stage1_extract.store_root import LOCK_FILE
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences, make_loader
from stage2_train.plan import PlanSampler
from stage2_train.train import run_train

FIX = "delete the shard folder and rerun the same `dflash extract` command"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_data(tmp_path_factory.mktemp("integrity-data"))


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by `dflash extract` (checksummed chunks, recorded file sizes)."""
    out = tmp_path_factory.mktemp("integrity-reference") / "store"
    run_extract(make_config(tiny_qwen3, data, out, LAYERS))
    return out


@pytest.fixture
def store(reference: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(reference, tmp_path / "store"))


def shard(store: Path, index: int) -> Path:
    return store / "shards" / f"shard-{index:06d}"


def data_file(store: Path, index: int, array: str) -> Path:
    (path,) = [p for p in (shard(store, index) / array / "c").rglob("*") if p.is_file()]
    return path


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10  # inside a chunk's bytes (the shard index is at the end)
    path.write_bytes(bytes(data))


def train_cfg(store: Path, out: Path, *sets: str) -> TrainConfig:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false", "optim.epochs=1"]
    return build_config(TrainConfig, DEBUG, "train", [*base, *sets])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_extract_records_every_file_of_every_shard(reference: Path) -> None:
    assert open_store(reference).attrs["format_version"] == 2
    for index in committed_shards(reference):
        folder = shard(reference, index)
        recorded = recorded_files(folder)
        on_disk = {
            p.relative_to(folder).as_posix(): p.stat().st_size
            for p in folder.rglob("*")
            if p.is_file() and p.relative_to(folder).as_posix() != "zarr.json"
        }
        assert recorded == on_disk and any(k.startswith("hidden/c/") for k in recorded)


DAMAGE = {
    "deleted": (lambda s: data_file(s, 1, "tokens").unlink(), "tokens", "is missing"),
    "truncated": (
        lambda s: os.truncate(data_file(s, 1, "loss_mask"), 10),
        "loss_mask",
        "is 10 bytes",
    ),
    "missing_shard": (lambda s: shutil.rmtree(shard(s, 1)), "-", "missing"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_train_refuses_a_damaged_store_before_step_1(store: Path, tmp_path: Path, case: str):
    damage, array, what = DAMAGE[case]
    damage(store)
    with pytest.raises(StoreError) as caught:
        run_train(train_cfg(store, tmp_path / "run"))
    message = str(caught.value)
    lines = message.splitlines()  # the store, a line per problem (here one), the fix
    assert len(lines) == 3 and lines[1].startswith("  - shard-000001") and what in lines[1]
    if array != "-":
        assert f"array {array}: file {array}/c/" in lines[1]
    assert "rerun the same `dflash extract` command" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was taken


@pytest.mark.parametrize("workers", [0, 2])
def test_a_chunk_that_fails_its_checksum_stops_training_with_one_line(
    store: Path, tmp_path: Path, workers: int
) -> None:
    flip_byte(data_file(store, 0, "hidden"))
    check_shards(open_store(store), [])  # same size: only decoding finds it
    cfg = train_cfg(store, tmp_path / "run", f"data.num_workers={workers}")
    with pytest.raises(StoreError) as caught:
        run_train(cfg)
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    assert "shard-000000 array hidden: cannot be decoded" in message and "checksum" in message
    assert FIX in message and "data.on_damaged=skip" in message


def test_on_damaged_skip_trains_and_counts(store: Path, tmp_path: Path) -> None:
    flip_byte(data_file(store, 0, "hidden"))
    out = tmp_path / "run"
    run_train(train_cfg(store, out, "data.on_damaged=skip", "run.log_every=1"))
    rows = read_metrics(out)
    assert rows and (out / "export").is_dir()
    # one sequence (one hidden chunk) is damaged, read once in the one epoch
    assert sum(r.get("skipped_damaged", 0) for r in rows) == 1
    assert all(r["loss"] == r["loss"] for r in rows)  # no NaN from the blank item


def argmax_sequences(info: StoreInfo) -> StoreSequences:
    """The dataset the trainer reads, at the tests' small settings (argmax labels, no distill)."""
    return StoreSequences(
        info,
        num_anchors=4,
        per_document=False,
        block_size=4,
        label_target="argmax",
        distill=False,
        seed=0,
    )


def test_a_file_deleted_after_the_check_never_reads_as_zeros(store: Path) -> None:
    info = open_store(store)
    ds = argmax_sequences(info)
    assert ds[(2, 0, False)]["damaged"] is None  # shard 1 opened and read
    data_file(store, 1, "target_argmax").unlink()
    item = ds[(3, 0, False)]
    assert "shard-000001 array target_argmax: file target_argmax/c/" in item["damaged"]
    assert item["index"] == -1 and float(item["weights_AB"].sum()) == 0.0

    class OneBatch(PlanSampler):
        def __init__(self) -> None:
            pass

        def __iter__(self):
            yield [(0, 0, False), (3, 0, False)]

        def __len__(self) -> int:
            return 1

    fresh = argmax_sequences(info)
    with pytest.raises(StoreError, match="shard-000001 array target_argmax"):
        list(make_loader(fresh, OneBatch(), 1, 2, False))
    (batch,) = list(make_loader(fresh, OneBatch(), 0, 2, False, on_damaged="skip"))
    assert len(batch.damaged) == 1 and batch.indices.tolist() == [0, -1]


def test_a_version_1_store_trains_unchecked_and_resumes_with_records(
    store: Path, tiny_qwen3: Path, data: Path, tmp_path: Path
) -> None:
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["dflash"]["format_version"] = 1
    meta.write_text(json.dumps(doc))
    for index in committed_shards(store):  # as version 1 wrote them: no record
        shard_meta = shard(store, index) / "zarr.json"
        sdoc = json.loads(shard_meta.read_text())
        del sdoc["attributes"][SHARD_ATTR][FILES_KEY]
        shard_meta.write_text(json.dumps(sdoc))
    check_shards(open_store(store), [])  # skipped, with a log line
    shutil.rmtree(shard(store, 1))
    run_extract(make_config(tiny_qwen3, data, store, LAYERS))  # resumes: the same content key
    info = open_store(store, require_complete=True)
    assert info.attrs["format_version"] == 1
    assert recorded_files(shard(store, 1)) and recorded_files(shard(store, 0)) is None
    data_file(store, 1, "tokens").unlink()
    with pytest.raises(StoreError, match="shard-000001 array tokens"):
        check_shards(info, [])


def rewrite_array(folder: Path, name: str, data: np.ndarray) -> None:
    """Replace one array of a shard, its file sizes recorded again: what a foreign or buggy
    writer leaves, which the size check before step 1 cannot see."""
    shutil.rmtree(folder / name)
    factory_array(zarr.open_group(folder, mode="r+"), name, data, chunk_tokens=2)
    record_shard_files(folder)


LAYOUT_DAMAGE = {
    # the direct reader failed on an assertion: 'cannot be decoded (AssertionError: (64,))'
    "short_loss_mask": ("loss_mask", lambda a: a[:, :-2], "shape (5, 62), expected (5, 64)"),
    # the same bytes a row: read without a word as other values
    "hidden_K_D_swapped": (
        "hidden",
        lambda a: np.ascontiguousarray(a.swapaxes(2, 3)),
        "shape (5, 64, 64, 2), expected (5, 64, 2, 64)",
    ),
    "float_tokens": ("tokens", lambda a: a.astype(np.float32), "dtype float32, expected int32"),
}


@pytest.mark.parametrize("case", LAYOUT_DAMAGE)
def test_train_reader_refuses_an_array_of_another_dtype_or_shape(tmp_path: Path, case: str):
    name, change, what = LAYOUT_DAMAGE[case]
    store = build_factory_store(tmp_path / "store")
    folder = shard(store, 1)
    rewrite_array(folder, name, change(zarr.open_array(folder / name, mode="r")[:]))
    info = open_store(store)
    check_shards(info, [])  # the sizes agree with the record
    ds = argmax_sequences(info)
    assert ds[(4, 0, False)]["damaged"] is None  # shard 0
    item = ds[(5, 0, False)]
    assert item["damaged"] == f"store {store}: shard-000001 array {name}: {what}; {REEXTRACT}"
    assert item["index"] == -1 and float(item["weights_AB"].sum()) == 0.0


def test_inspect_verify_catches_a_deleted_doc_piece_chunk(store: Path) -> None:
    index = next(
        i for i in committed_shards(store) if (shard(store, i) / "doc_piece" / "c").is_dir()
    )
    assert verify_store(store)["ok"]
    data_file(store, index, "doc_piece").unlink()
    problems = verify_store(store)["problems"]
    assert [(p["shard"], p["array"]) for p in problems] == [(f"shard-{index:06d}", "doc_piece")]
    assert problems[0]["problem"].startswith("file doc_piece/c/0 is missing")


def _hold_lock(store: Path) -> subprocess.Popen:
    """Another process holding the store's writer lock, as a running extract does."""
    code = (
        "import sys; from pathlib import Path; from stage1_extract.store_root import writer_lock\n"
        "with writer_lock(Path(sys.argv[1])):\n"
        "    print('locked', flush=True); sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(store)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_writer_is_refused_and_overwrite_deletes_nothing(
    store: Path, tiny_qwen3: Path, data: Path, reference: Path
) -> None:
    shutil.rmtree(shard(store, 2))  # work left for a writer
    holder = _hold_lock(store)
    try:
        for extra in ((), ("store.overwrite=true",)):
            result = cli_extract(tiny_qwen3, data, store, LAYERS, *extra)
            message = " ".join(result.output.split())
            assert result.exit_code == 2, result.output
            assert f"being written by another `dflash extract` (pid {holder.pid} " in message
            assert f"on host {socket.gethostname()}" in message
            assert committed_shards(store) == [i for i in committed_shards(reference) if i != 2]
    finally:
        holder.kill()  # as kill -9: the kernel releases the lock
        holder.wait()
    result = cli_extract(tiny_qwen3, data, store, LAYERS)
    assert result.exit_code == 0, result.output
    assert_same_store(store, reference)
    assert (store / LOCK_FILE).read_text() == ""  # released: no holder named


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG])
def test_out_of_space_while_writing_a_shard_then_a_rerun_completes_it(
    code: int, tiny_qwen3: Path, data: Path, reference: Path, tmp_path: Path, monkeypatch
) -> None:
    real_set = LocalStore.set

    async def failing_set(self, key, value):
        if ".tmp-shard-000002-" in str(self.root) and key.startswith("hidden/c"):
            raise OSError(code, os.strerror(code))
        return await real_set(self, key, value)

    monkeypatch.setattr(LocalStore, "set", failing_set)
    out = tmp_path / "store"
    cfg = make_config(tiny_qwen3, data, out, LAYERS, "run.writer_processes=0")
    with pytest.raises(StoreError) as caught:
        run_extract(cfg)
    message = str(caught.value)
    assert "\n" not in message and "shard 2 " in message and str(out / "shards") in message
    assert "a shard needs up to" in message and "rerun the same command" in message
    if code == errno.EFBIG:
        assert message.startswith("file-size limit hit") and "ulimit -f" in message
    else:
        assert message.startswith("disk full") and "GiB free" in message
    assert 2 not in committed_shards(out) and not list((out / "shards").glob(".tmp-*"))
    assert not open_store(out).complete

    monkeypatch.setattr(LocalStore, "set", real_set)
    run_extract(cfg)  # the same command once there is room
    assert_same_store(out, reference)
