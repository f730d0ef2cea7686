"""bench/head_post.py (part 4 of bench/bench_extract.py) runs on the CPU at a tiny shape: no
timing asserted (speed is the benchmark's report), but both paths must agree with plain ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_head_post_tiny_runs_and_agrees() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "bench" / "head_post.py"), "--device", "cpu"]
    command += ["--tokens", "300", "--chunk", "128", "--vocab", "3000", "--hidden", "64"]
    done = subprocess.run(
        [*command, "--repeats", "1"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["what"] == "head_post" and (record["chunks"], record["tail_rows"]) == (3, 44)
    assert record["post_eager_ms"] > 0 and record["post_compiled_ms"] > 0
    for path in ("eager_vs_plain_ops", "compiled_vs_plain_ops"):
        agree = record[path]
        assert agree["argmax_mismatched_rows"] == 0, path
        assert agree["topk_values_equal"] and agree["topk_ids_hold_values"], path
        assert agree["lse_max_abs_diff"] < 1e-4, path
    assert record["eager_vs_plain_ops"]["lse_max_abs_diff"] == 0.0
