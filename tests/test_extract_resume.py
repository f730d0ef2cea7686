"""Resuming and multi-process extraction give the store of one uninterrupted process, bit for
bit: a run SIGKILLed after its second shard commit then rerun, a run over two CPU processes
(gloo), and a rerun of a finished store (which writes nothing)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from test_extract import DEBUG, SMALL, file_digests, make_config, write_data

from common.logging import LEVEL_ENV, get_logger, init_logger
from common.store import StoreError, committed_shards, open_store
from stage1_extract.run import run_extract
from stage1_extract.shard_writer import KILL_ENV

REPO = Path(__file__).parents[1]
LAYERS = "target.tapped_layers=[0,1,3]"
# bookkeeping that legitimately differs between runs of the same content
VOLATILE = {"created_by", "extract_config"}


def store_contents(store: Path) -> dict[str, Any]:
    """Everything a reader sees: root attributes, head bytes, shard attributes and arrays."""
    root = {k: v for k, v in open_store(store, require_complete=True).attrs.items()}
    out: dict[str, Any] = {"root": {k: v for k, v in root.items() if k not in VOLATILE}}
    out["head"] = (store / "target_head.safetensors").read_bytes()
    for index in committed_shards(store):
        group = zarr.open_group(store / "shards" / f"shard-{index:06d}", mode="r")
        out[f"{index}/attrs"] = dict(group.attrs)
        for name, array in group.arrays():
            out[f"{index}/{name}"] = array[...]
    return out


def assert_same_store(got: Path, want: Path) -> None:
    a, b = store_contents(got), store_contents(want)
    assert sorted(a) == sorted(b)
    for key in b:
        if isinstance(b[key], np.ndarray):
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_data(tmp_path_factory.mktemp("resume-data"))


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume-reference") / "store"
    run_extract(make_config(tiny_qwen3, data, out, LAYERS))
    return out


def _extract_killed_after_two_commits(
    model: Path, data: Path, out: Path, *extra: str, env: dict[str, str] | None = None
) -> None:
    """`dflash extract` in a subprocess that SIGKILLs itself after its second shard commit."""
    sets = [arg for item in (*SMALL, LAYERS, *extra) for arg in ("--set", item)]
    command = [sys.executable, "-m", "dflash_offline.cli", "extract", "--config", str(DEBUG)]
    command += ["--model", str(model), "--data", str(data), "--out", str(out), *sets]
    full_env = dict(os.environ, **{KILL_ENV: "2"}, **(env or {}))
    # a surviving writer would hold the output pipes open: run() would wait for it forever
    killed = subprocess.run(
        command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr[-2000:]


def test_killed_run_resumes_to_the_same_store(reference, tiny_qwen3, data, tmp_path):
    out = tmp_path / "store"
    _extract_killed_after_two_commits(tiny_qwen3, data, out)
    done = committed_shards(out)
    total = open_store(out).num_shards
    assert 2 <= len(done) < total and not open_store(out).complete
    stale = out / "shards" / ".tmp-shard-000099-12345"  # as a kill mid-write leaves behind
    stale.mkdir()
    (stale / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))

    run_extract(make_config(tiny_qwen3, data, out, LAYERS))  # the same command again
    assert not stale.exists()
    assert_same_store(out, reference)


def test_writer_processes_write_the_same_store_and_log_its_timeline(
    reference, tiny_qwen3, data, tmp_path, monkeypatch
):
    out = tmp_path / "store"
    monkeypatch.setenv(LEVEL_ENV, "debug")
    messages: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    get_logger().addHandler(collect)
    try:
        run_extract(make_config(tiny_qwen3, data, out, LAYERS, "run.writer_processes=2"))
    finally:
        get_logger().removeHandler(collect)
        init_logger(logging.INFO)
    assert_same_store(out, reference)
    # the debug timeline: the target loads while the writers start, then each shard is
    # committed once; the summary says when the writers were ready and how long the drain took
    loaded = [i for i, m in enumerate(messages) if "target loaded, the first shard" in m]
    commits = [
        (i, int(m.split("shard ")[1].split()[0]))
        for i, m in enumerate(messages)
        if " committed, handed to a writer at t=" in m
    ]
    assert len(loaded) == 1 and all(i > loaded[0] for i, _ in commits)
    assert sorted(shard for _, shard in commits) == committed_shards(out)
    summary = next(m for m in messages if m.startswith("rank 0:") and "tokens/s" in m)
    assert re.search(r"ready after \d+\.\d s", summary) and "drained in" in summary


def test_a_log_level_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setenv(LEVEL_ENV, "LOUD")
    with pytest.raises(ValueError, match="DFLASH_LOG_LEVEL='LOUD' is not a level"):
        init_logger()


def _processes_marked(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (the run and its writer processes)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def test_killed_run_with_writer_processes_leaves_none_behind_and_resumes(
    reference, tiny_qwen3, data, tmp_path
):
    out = tmp_path / "store"
    marker = f"DFLASH_TEST_RUN={uuid.uuid4().hex}"
    name, value = marker.split("=")
    _extract_killed_after_two_commits(
        tiny_qwen3, data, out, "run.writer_processes=2", env={name: value}
    )
    deadline = time.monotonic() + 10
    while _processes_marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_marked(marker) == [], "writer processes outlived the killed extraction"
    assert 2 <= len(committed_shards(out)) < open_store(out).num_shards

    run_extract(make_config(tiny_qwen3, data, out, LAYERS, "run.writer_processes=2"))
    assert_same_store(out, reference)


@pytest.mark.parametrize("writers", ["run.writer_processes=0", "run.writer_processes=2"])
def test_nan_target_is_refused_by_either_kind_of_writer(writers, tiny_qwen3, data, tmp_path):
    from transformers import AutoModelForCausalLM

    broken = tmp_path / "nan-target"
    shutil.copytree(tiny_qwen3, broken)
    model = AutoModelForCausalLM.from_pretrained(broken)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    out = tmp_path / "store"
    with pytest.raises(StoreError, match="NaN/Inf"):
        run_extract(make_config(broken, data, out, LAYERS, writers))
    assert committed_shards(out) == [] and not list((out / "shards").glob(".tmp-*"))


@pytest.mark.parametrize("writers", ["run.writer_processes=0", "run.writer_processes=2"])
def test_two_cpu_processes_write_the_same_store(writers, reference, tiny_qwen3, data, tmp_path):
    out = tmp_path / "store"
    run_extract(make_config(tiny_qwen3, data, out, LAYERS, "run.devices=cpu,cpu", writers))
    assert_same_store(out, reference)


def test_rerun_of_a_finished_store_writes_nothing(reference, tiny_qwen3, data):
    before = file_digests(reference)
    run_extract(make_config(tiny_qwen3, data, reference, LAYERS))
    assert file_digests(reference) == before
