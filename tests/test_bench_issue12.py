"""bench/profile_train_step.py runs on the CPU at its tiny shape and bench/issue12_summary.py
reads what it wrote (no timing asserted: speed is the benchmark's report); the device script
bench/issue12_call.sh parses. The flex sweep and the GPU kernel categories run only on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from store_factory import FactorySpec, build_store

ROOT = Path(__file__).resolve().parents[1]


def profile_tiny(out: Path, profile_steps: int) -> list[dict]:
    """bench/profile_train_step.py at the tiny shape on the CPU: its records."""
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "bench" / "profile_train_step.py"), "--shape", "tiny"]
    command += ["--device", "cpu", "--compile-layers", "false", "--warmup", "0", "--steps", "1"]
    command += ["--profile-steps", str(profile_steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in (out / "train_profile.jsonl").open()]


def test_train_profile_tiny_and_summary(tmp_path: Path) -> None:
    setup, step, profile = profile_tiny(tmp_path, profile_steps=1)
    assert setup["what"] == "train_setup" and setup["not_scoped"] == []
    assert step["what"] == "train_step" and step["status"] == "ok" and step["median_step_ms"] > 0
    assert profile["what"] == "train_profile"
    # every scope this script wraps around the project's code shows up as its category
    assert {"mask_build", "lm_head_loss", "attention_fwd", "optimizer"} <= set(
        profile["categories"]
    )
    assert abs(sum(c["share"] for c in profile["categories"].values()) - 1) < 0.01

    (tmp_path / "parts.jsonl").write_text('{"part": "train_pystd", "rc": 0, "wall_s": 9}\n')
    summary = [sys.executable, str(ROOT / "bench" / "issue12_summary.py"), str(tmp_path)]
    assert subprocess.run(summary, capture_output=True, timeout=60).returncode == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "tiny, compile_layers=False" in text and "train_pystd: ok" in text


def test_train_profile_timings_only(tmp_path: Path) -> None:
    """--profile-steps 0: the step's timing without a profile (it once failed on no steps);
    the setup says whether the loss chunks were compiled (off on the CPU by default)."""
    records = profile_tiny(tmp_path, profile_steps=0)
    assert [r["what"] for r in records] == ["train_setup", "train_step"]
    assert records[0]["compile_chunks"] is False and records[1]["status"] == "ok"
    assert records[1]["read_late_step_ms"] > 0  # the same steps, each read after the next


def test_issue12_call_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "issue12_call.sh")]).returncode == 0


def test_flex_gate_runs_its_forward_checks_on_the_cpu() -> None:
    """bench/flex_gate.py, which decides a GPU run's mask tiles, works end to end (on the CPU:
    the forward checks only, against fp32 SDPA on the dense mask); its narrow-table case runs
    too, on tables widened back (flex's CPU lowering needs the full width)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "bench" / "flex_gate.py"), "--device", "cpu"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["ok"] and record["tile"] == 64
    assert record["bf16_err"]["out"] < 1e-2 and record["fp32_err"]["out"] < 1e-4
    narrow = record["narrow"]
    assert record["narrow_ok"] and narrow["max_abs_diff"] == {"out": 0.0}, narrow
    assert narrow["widths"][0] < narrow["grid"][1] and narrow["err"]["out"] < 1e-2
    assert "widened back" in narrow["note"]
    assert record["narrow_fp32"]["max_abs_diff"] == {"out": 0.0}


def test_loader_cost_reads_a_store(tmp_path: Path) -> None:
    """bench/loader_cost.py times a real store's batch stages (full and narrow tables)."""
    store = build_store(tmp_path / "store", FactorySpec(hidden_dtype="float8_e4m3fn"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "bench" / "loader_cost.py"), "--store", str(store)]
    command += ["--sequences", "2", "3", "--batches", "1", "--anchors", "4", "--block-size", "4"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [r["sequences"] for r in records] == [2, 3]
    stages = {"read_ms", "item_ms", "collate_ms", "tables_full_ms", "tables_narrow_ms"}
    for record in records:  # (what each took is the benchmark's report, not asserted)
        assert stages | {"batch_full_ms", "batch_narrow_ms"} <= record.keys()
        assert all(isinstance(record[key], (int, float)) for key in stages)


def test_fp8_variants_on_a_bf16_store(tmp_path: Path) -> None:
    """bench/fp8_variants.py requantizes a bf16 store's features: e5m2 (2 mantissa bits) errs
    more than e4m3 (3), the 4-bit layouts (1 mantissa bit) more still and take fewer bytes,
    and every variant is smaller than bf16."""
    store = build_store(tmp_path / "store", FactorySpec(hidden_dtype="bfloat16"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "bench" / "fp8_variants.py"), "--store", str(store)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    bf16, *variants = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert bf16["variant"] == "bf16" and len(variants) == 5
    e4m3, e5m2, per_channel, mxfp4, nvfp4 = variants
    assert e4m3["rel_rms_error"] < e5m2["rel_rms_error"] < 0.2
    assert per_channel["rel_rms_error"] < 0.1
    for fp4 in (mxfp4, nvfp4):
        assert e5m2["rel_rms_error"] < fp4["rel_rms_error"] < 0.3
        assert fp4["bytes_per_token"] < e5m2["bytes_per_token"]
    assert all(v["bytes_per_token"] < bf16["bytes_per_token"] for v in variants)
