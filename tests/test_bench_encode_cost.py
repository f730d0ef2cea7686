"""bench/encode_cost.py runs on the CPU at a few tokens: no timing asserted (speed is the
benchmark's report), but every part reports, and the compiled nvfp4 encoder writes the eager
encoder's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_encode_cost_tiny_runs_and_agrees(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OUT": str(tmp_path)}
    command = [sys.executable, str(ROOT / "bench" / "encode_cost.py"), "--device", "cpu"]
    done = subprocess.run(
        [*command, "--tokens", "32", "--repeats", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    records = [
        json.loads(line) for line in (tmp_path / "encode_cost.jsonl").read_text().splitlines()
    ]
    check, yardstick, *rest = records
    encodes = [r for r in rest if r["part"] == "encode"]
    profiled = [r for r in rest if r["part"] == "profile_nvfp4_compiled"]
    decodes = [r for r in rest if r["part"] == "decode"]
    assert len(encodes) + len(profiled) + len(decodes) == len(rest)
    # training's decode of the same features, eager and compiled, per store dtype
    assert [(r["hidden_dtype"], r["compiled"]) for r in decodes] == [
        ("float8_e4m3fn", False),
        ("float8_e4m3fn", True),
        ("nvfp4", False),
        ("nvfp4", True),
    ]
    assert all(r["values_equal"] and r["decode_ms_per_layer"] > 0 for r in decodes)
    # where the compiled encoder's time goes: its operators (the CPU's; a GPU's kernels)
    assert 0 < len(profiled) <= 12 and all(r["ms_per_encode"] >= 0 for r in profiled)
    # the reductions over the features run inside the compiled regions, none eager (they did
    # before the fortieth session: amax, abs and the least-error argmin); the kept-so-far start
    # is made eager, so an eager operator shows where it runs
    operators = {r["kernel"] for r in profiled}
    assert "aten::zeros" in operators
    assert not operators & {"aten::amax", "aten::abs", "aten::argmin", "aten::stack"}, operators
    assert check["part"] == "nvfp4_compiled_vs_eager"
    assert check["rows_equal"] and check["scales_equal"] and check["rows_differing"] == 0
    assert check["fp8_rows_differing"] == 0 and check["fp8_scales_equal"]
    assert yardstick["part"] == "yardstick" and yardstick["layer_forward_ms"] > 0
    assert [r["hidden_dtype"] for r in encodes] == [
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fn_compiled",
        "nvfp4_eager",
        "nvfp4_compiled",
    ]
    assert all(r["encode_ms_per_layer"] > 0 and r["tokens"] == 32 for r in encodes)
