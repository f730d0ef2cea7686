"""Benchmark: `dflash train` steps of a Qwen3-8B-size drafter from a store on disk, one GPU.

Runs the real `run_train` (loader workers reading the Zarr shards, compiled-region flex
attention, chunked LM-head loss, AdamW) on a store written by `bench/bench_extract.py --keep`
(hidden 4096, 5 tapped layers, vocab 151,936, 3,072-token sequences), 512 anchors x block 16,
and reads its metrics.jsonl: median step time after warm-up, query tokens/s, model FLOP
utilisation against the measured 790 TFLOP/s bf16 matrix rate, the share of the step spent
waiting on the loader, and peak GPU memory. JSON to stdout and $OUT/bench_train.jsonl.

    python bench/bench_train.py --store /tmp/bench-extract/store [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from common.config import build_config
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

MATRIX_RATE = 790e12  # bf16 dense, measured on the H200 (notes/performance.md)


def model_flops(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    layers: int,
    vocab: int,
    tapped: int,
    context: int,
    queries: int,
) -> float:
    """Training FLOPs of one step, counted like the yardstick: 6 x params x tokens for the
    layers on the query tokens, the K/V projections of the context per layer, fc on the
    context, and forward + input gradient of the frozen LM head on the query tokens."""
    attn = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
    layer_params = layers * (attn + 3 * hidden * ffn)
    kv_params = 2 * hidden * kv_heads * head_dim
    return (
        6 * layer_params * queries
        + 6 * kv_params * layers * context
        + 6 * tapped * hidden * hidden * context
        + 4 * vocab * hidden * queries
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", default="/tmp/bench-train")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    cfg = build_config(
        TrainConfig,
        Path("configs/qwen3-8b.yaml"),
        "train",
        [
            f"data.store={args.store}",
            f"run.out={args.out}",
            "run.devices=0",
            f"optim.max_steps={args.steps}",
            "run.eval_every=0",
            "run.checkpoint_every=0",
            "data.holdout_sequences=4",
            "run.progress=false",
            "run.log_every=5",
            *args.overrides,
        ],
    )
    metrics = Path(args.out) / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    for old in Path(args.out).glob("step-*"):
        import shutil

        shutil.rmtree(old)
    t0 = time.perf_counter()
    run_train(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = rows[args.warmup :]
    step_s = statistics.median(r["step_s"] for r in steady)
    compute_s = statistics.median(r["compute_s"] for r in steady)
    wait = sum(r["step_s"] - r["compute_s"] for r in steady) / sum(r["step_s"] for r in steady)
    attrs = json.loads((Path(args.store) / "zarr.json").read_text())["attributes"]["dflash"]
    tc = attrs["target"]["config"]
    queries = cfg.anchors.num_anchors * cfg.drafter.block_size
    flops = model_flops(
        tc["hidden_size"],
        tc["num_attention_heads"],
        tc["num_key_value_heads"],
        tc["head_dim"],
        tc["intermediate_size"],
        cfg.drafter.num_layers,
        attrs["vocab_size"],
        len(attrs["tapped_layers"]),
        attrs["seq_len"],
        queries,
    )
    record = {
        "what": "train_step",
        "steps": len(rows),
        "warmup_steps": args.warmup,
        "median_step_ms": round(step_s * 1e3, 1),
        "median_compute_ms": round(compute_s * 1e3, 1),
        "query_tokens_per_s": round(queries / step_s),
        "context_tokens_per_s": round(attrs["seq_len"] / step_s),
        "model_TFLOP_per_step": round(flops / 1e12, 1),
        "achieved_TFLOPs": round(flops / step_s / 1e12),
        "mfu_vs_790": round(flops / step_s / MATRIX_RATE, 3),
        "loader_wait_share": round(wait, 3),
        "peak_gpu_GB": max(r["mem_gb"] for r in rows),
        "first_step_s_incl_compile": rows[0]["step_s"],
        "wall_s": round(wall, 1),
        "losses_first_last": [round(rows[0]["loss"], 3), round(rows[-1]["loss"], 3)],
        "overrides": args.overrides,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "bench_train.jsonl", "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
