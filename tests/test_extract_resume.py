"""Resuming and multi-process extraction give the store of one uninterrupted process, bit for
bit: a run SIGKILLed after its second shard commit then rerun, a run over two CPU processes
(gloo), and a rerun of a finished store (which writes nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from test_extract import DEBUG, SMALL, file_digests, make_config, write_data

from common.store import committed_shards, open_store
from stage1_extract.run import run_extract
from stage1_extract.writer import KILL_ENV

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


def test_killed_run_resumes_to_the_same_store(reference, tiny_qwen3, data, tmp_path):
    out = tmp_path / "store"
    sets = [arg for item in (*SMALL, LAYERS) for arg in ("--set", item)]
    command = [sys.executable, "-m", "common.cli", "extract", "--config", str(DEBUG)]
    command += ["--model", str(tiny_qwen3), "--data", str(data), "--out", str(out), *sets]
    env = dict(os.environ, **{KILL_ENV: "2"})
    killed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = committed_shards(out)
    total = open_store(out).num_shards
    assert 2 <= len(done) < total and not open_store(out).complete
    stale = out / "shards" / ".tmp-shard-000099-12345"  # as a kill mid-write leaves behind
    stale.mkdir()
    (stale / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))

    run_extract(make_config(tiny_qwen3, data, out, LAYERS))  # the same command again
    assert not stale.exists()
    assert_same_store(out, reference)


def test_two_cpu_processes_write_the_same_store(reference, tiny_qwen3, data, tmp_path):
    out = tmp_path / "store"
    run_extract(make_config(tiny_qwen3, data, out, LAYERS, "run.devices=cpu,cpu"))
    assert_same_store(out, reference)


def test_rerun_of_a_finished_store_writes_nothing(reference, tiny_qwen3, data):
    before = file_digests(reference)
    run_extract(make_config(tiny_qwen3, data, reference, LAYERS))
    assert file_digests(reference) == before
