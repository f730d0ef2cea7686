"""bench/nvfp4_layouts.py on a small nvfp4 store: every layout it compresses holds the chunk's
bytes once (the streams put back together are the chunk), and the script's report names them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from store_factory import FactorySpec, build_store

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from nvfp4_layouts import layouts  # noqa: E402


def test_each_layout_is_the_chunks_bytes_cut_differently() -> None:
    chunk_TKW = np.random.default_rng(0).integers(0, 256, size=(8, 3, 9 * 4), dtype=np.uint8)
    streams = layouts(chunk_TKW)
    assert np.array_equal(streams["rows"][0], chunk_TKW)
    assert np.array_equal(np.concatenate(streams["split"], axis=-1), chunk_TKW)
    assert streams["split"][1].shape[-1] == 4  # the D/16 block scales, after D/2 code bytes
    assert np.array_equal(np.concatenate(streams["column9"], axis=-1), chunk_TKW)
    assert np.array_equal(streams["transpose_w_first"][0].transpose(1, 2, 0), chunk_TKW)


def test_the_script_reports_every_layout_against_the_stores_rows(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=4, hidden_dtype="nvfp4"))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "nvfp4_layouts.py"),
            "--store",
            str(store),
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = {r["layout"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(records) == {"rows", "split", "transpose_w_first", "column9"}
    assert records["rows"]["vs_rows"] == 1.0
    assert records["column9"]["read_cpu_ms_per_sequence"] > 0
    assert records["column9"]["column9_read_vs_rows"] > 0
    assert all(r["hidden_bytes_per_token"] > 0 for r in records.values())
