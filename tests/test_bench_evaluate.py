"""bench/bench_evaluate.py runs end to end on the CPU with its tiny target (no timing asserted:
speed is the benchmark's report), and there both paths must generate the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "sampled", [[], ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "5"]]
)
def test_bench_evaluate_tiny_runs_and_paths_agree(tmp_path: Path, sampled: list[str]) -> None:
    # one thread: the bench's ops are tiny, and the test machine's cores are shared
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "bench" / "bench_evaluate.py"), "--tiny"]
    command += ["--device", "cpu", "--dtype", "float32", "--num-prompts", "2"]
    command += ["--prompt-tokens", "24", "--new-tokens", "12", "--drafter-layers", "2", *sampled]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "bench_evaluate.jsonl").open()]
    timed = [r for r in records if r["what"] == "evaluate"]
    assert {(r["method"], r["path"]) for r in timed} == {
        (method, path) for method in ("prompt_lookup", "dflash") for path in ("cached", "reference")
    }
    assert all(r["generated_tokens"] == 2 * 12 and r["tokens_per_s"] > 0 for r in timed)
    speedups = [r for r in records if r["what"] == "evaluate_speedup"]
    assert len(speedups) == 2 and all(r["identical_tokens"] for r in speedups)
    assert all(r["temperature"] == (0.8 if sampled else 0.0) for r in timed)
    assert all(r["top_k"] == (5 if sampled else 0) for r in timed)
