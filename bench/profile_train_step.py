"""Benchmark: where one `dflash train` optimizer step spends its GPU time (issue 12).

Synthetic packed sequences (random tokens, documents of ~1/8 to ~3/10 of a sequence with a
16-token prompt carrying no loss, random bf16 features) go through the project's own path:
items shaped like `StoreSequences`' (project anchor sampling and block labels) ->
`stage2_train.data.collate` -> `StepRunner.step` (batch to the device, `forward_batch` with the
compiled-region flex attention and its per-step BlockMask, the chunked LM-head loss, backward,
clipping, fused AdamW), at the pystd recipe's shape (configs/pystd.yaml: 16 sequences x 2,560
tokens per step, three tapped layers, 512 anchors x 16 each, `mixed`) or the Qwen3-8B drafter's
(configs/qwen3-8b.yaml; bench/shapes.py). There is no loader: reading and decoding the store
is not in these figures (bench/bench_train.py times the real loop from a store).

For run.compile_layers=false, then true (same process, same batches; `--compile-layers`):
median step time over `--steps` after `--warmup` (each step read back at once), the mean step
of `--steps` more as `dflash train` runs them on one GPU (run.read_metrics_late: step s+1
queued before step s's metrics are read; `read_late_step_ms`), tokens/s, model TFLOP/s and MFU counted as in
bench_train.py, peak memory, first-step time; then torch.profiler over `--profile-steps` steps:
GPU kernel time per step by category (attention fwd/bwd, mask build, LM head + loss, matmuls
fwd/bwd, optimizer + clipping, copies, other fwd/bwd), the share of the step the GPU is busy,
and the top kernels (`--profile-steps 0`: timings only). loss.compile_chunks is as `dflash
train` decides it (on for a GPU): `--set loss.compile_chunks=false` for the eager loss. Categories come from record_function scopes this script wraps around
BlockAttention's construction (mask build), block_attention (attention) and chunked_block_loss
(loss), plus kernel and autograd-node names (bench/profile_events.py); the synthetic batches
and the shapes are bench/synthetic_batches.py's. JSON lines to stdout and
$OUT/train_profile.jsonl; `--trace F` also writes a gzipped Chrome trace of the first phase.

    python bench/profile_train_step.py --shape pystd                  # needs a CUDA GPU
    python bench/profile_train_step.py --shape qwen3-8b --compile-layers false
    python bench/profile_train_step.py --shape tiny --device cpu      # CPU smoke: ops' CPU time
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_train import MATRIX_RATE, model_flops  # bench/ is on sys.path: scripts run as bench/x.py
from jsonl import emit_to
from profile_events import breakdown, instrument
from synthetic_batches import SHAPES, synthetic_batches
from torch._dynamo.utils import counters

from common.config import build_config
from stage2_train.anchors import training_slot_weights
from stage2_train.config import TrainConfig, with_compile_defaults
from stage2_train.fp8 import convert_to_fp8
from stage2_train.model import DFlashDrafter, drafter_shape
from stage2_train.step import FrozenHead
from stage2_train.trainstep import StepRunner, run_dtypes

ROOT = Path(__file__).resolve().parents[1]


emit = emit_to("train_profile.jsonl")


class Bench:
    """One shape: model, frozen head, StepRunner and a few synthetic batches."""

    def __init__(self, args: argparse.Namespace) -> None:
        config, target, tapped, seq_len, mask_id, extra = SHAPES[args.shape]
        self.device = torch.device(args.device)
        # loss.compile_chunks as `dflash train` decides it (on for a GPU unless --set);
        # run.compile_layers is this bench's --compile-layers phases instead
        self.cfg = with_compile_defaults(
            build_config(
                TrainConfig,
                ROOT / config,
                "train",
                ["data.store=synthetic", "run.out=unused", *extra, *args.overrides],
            ),
            on_gpu=self.device.type == "cuda",
        )
        cfg = self.cfg
        vocab, hidden = target["vocab_size"], target["hidden_size"]
        self.shape = drafter_shape(cfg.drafter, target, tapped, vocab, mask_id)
        self.seq_len, self.tapped = seq_len, tapped
        param_dtype, compute_dtype = run_dtypes(cfg.run.dtype)
        torch.manual_seed(cfg.run.seed)
        with self.device:
            self.model = DFlashDrafter(self.shape).to(dtype=param_dtype)
        if cfg.run.fp8_linear is not None:  # --set run.fp8_linear=rowwise: as train.py does it
            per_batch = cfg.optim.batch_sequences
            tokens = (
                per_batch * seq_len,
                per_batch * cfg.anchors.num_anchors * cfg.drafter.block_size,
            )
            convert_to_fp8(self.model, cfg.run.fp8_linear, self.device, tokens)
        with self.device:
            scale = 4.0 / hidden**0.5  # logits O(4) for a unit-RMS hidden state, like a real head
            head = FrozenHead(
                (torch.randn(vocab, hidden) * scale).to(compute_dtype),
                (torch.randn(vocab, hidden) * scale).to(compute_dtype),
                torch.ones(hidden),
            )
        slot_w_B = training_slot_weights(
            cfg.drafter.block_size, cfg.loss.weighting, cfg.loss.gamma
        ).to(self.device)
        backend = "flex" if self.device.type == "cuda" and cfg.run.compile_attention else "sdpa"
        self.runner = StepRunner(
            self.model, self.model, head, cfg, slot_w_B, backend, self.device, 10**6
        )
        per_batch = cfg.optim.batch_sequences
        pin = self.device.type == "cuda"
        rows = cfg.drafter.block_size * self.runner.heads_per_group  # run.pack_heads
        self.batches = synthetic_batches(
            args.num_batches, seq_len, tapped, hidden, vocab, cfg, pin, rows_per_block=rows
        )
        self.step_index = 0
        context, queries = (
            per_batch * seq_len,
            per_batch * cfg.anchors.num_anchors * cfg.drafter.block_size,
        )
        s = self.shape
        flops = model_flops(
            s.hidden_size,
            s.num_attention_heads,
            s.num_key_value_heads,
            s.head_dim,
            s.intermediate_size,
            s.num_layers,
            vocab,
            tapped,
            context,
            queries,
        )
        self.context, self.queries, self.flops = context, queries, flops * cfg.optim.grad_accum

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> tuple[float, dict]:
        micro = [
            self.batches[(self.step_index + i) % len(self.batches)]
            for i in range(self.cfg.optim.grad_accum)
        ]
        self.step_index += 1
        self.sync()
        t0 = time.perf_counter()
        record = self.runner.step(micro)
        self.sync()
        return time.perf_counter() - t0, record

    def steps_read_late(self, count: int) -> float:
        """Mean wall time of `count` steps run as `dflash train` runs them on one GPU
        (run.read_metrics_late): step s+1 is queued before step s's metrics are read."""
        self.sync()
        t0 = time.perf_counter()
        unread = None
        for _ in range(count):
            micro = [
                self.batches[(self.step_index + i) % len(self.batches)]
                for i in range(self.cfg.optim.grad_accum)
            ]
            self.step_index += 1
            pending = self.runner.queue(micro)
            if unread is not None:
                unread.read()
            unread = pending
        if unread is not None:
            unread.read()
        self.sync()
        return (time.perf_counter() - t0) / max(count, 1)

    def measure(self, args: argparse.Namespace, compiled_layers: bool) -> dict[str, Any]:
        first_s, first = self.step()
        for _ in range(args.warmup):
            self.step()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        timed = [self.step() for _ in range(args.steps)]
        step_s = statistics.median(t for t, _ in timed)
        compute_s = statistics.median(r["compute_s"] for _, r in timed)
        accum = self.cfg.optim.grad_accum
        record = {
            "what": "train_step",
            "shape": args.shape,
            "compile_layers": compiled_layers,
            "status": "ok",
            "first_step_s": round(first_s, 2),
            "steps": args.steps,
            "median_step_ms": round(step_s * 1e3, 2),
            "min_step_ms": round(min(t for t, _ in timed) * 1e3, 2),
            "median_compute_ms": round(compute_s * 1e3, 2),
            "query_tokens_per_s": round(self.queries * accum / step_s),
            "context_tokens_per_s": round(self.context * accum / step_s),
            "model_TFLOP_per_step": round(self.flops / 1e12, 2),
            "achieved_TFLOPs": round(self.flops / step_s / 1e12, 1),
            "mfu_vs_790": round(self.flops / step_s / MATRIX_RATE, 4),
            "losses_first_last": [round(first["loss"], 4), round(timed[-1][1]["loss"], 4)],
        }
        if self.device.type == "cuda":
            record["peak_gpu_GB"] = round(torch.cuda.max_memory_allocated(self.device) / 1e9, 2)
        if compiled_layers and self.cfg.run.cuda_graphs:
            # graphs inductor declined to replay as CUDA graphs (it logs why; 0 = all replayed)
            record["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        # the same steps with each one's metrics read after the next is queued
        late_s = self.steps_read_late(args.steps)
        record["read_late_step_ms"] = round(late_s * 1e3, 2)
        record["read_late_speedup"] = round(step_s / late_s, 3)
        return record

    def profile(self, args: argparse.Namespace, compiled_layers: bool, trace: str | None) -> dict:
        activities = [torch.profiler.ProfilerActivity.CPU]
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        walls = []
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                walls.append(self.step()[0])
        t0 = time.perf_counter()
        record = {
            "what": "train_profile",
            "shape": args.shape,
            "compile_layers": compiled_layers,
            "profiled_steps": args.profile_steps,
            "step_ms_while_profiled": round(statistics.median(walls) * 1e3, 2),
            "unit": "GPU kernel time" if on_cuda else "CPU self time of ops (smoke)",
            **breakdown(prof, args.profile_steps, compiled_layers, on_cuda),
        }
        record["busy_share"] = round(
            record["kernel_ms_per_step"] / record["step_ms_while_profiled"], 3
        )
        if trace:
            raw = trace.removesuffix(".gz")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
            record["trace"] = raw + ".gz"
        record["analysis_s"] = round(time.perf_counter() - t0, 1)
        return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="pystd")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-layers", choices=["false", "true", "both"], default="both")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=10, help="0: no profile")
    parser.add_argument("--num-batches", type=int, default=2, help="distinct batches, cycled")
    parser.add_argument("--trace", default=None, help="gzipped Chrome trace of the first phase")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    missing = instrument()
    t0 = time.perf_counter()
    bench = Bench(args)
    s = bench.shape
    emit(
        {
            "what": "train_setup",
            "shape": args.shape,
            "drafter": {
                "hidden": s.hidden_size,
                "layers": s.num_layers,
                "heads": [s.num_attention_heads, s.num_key_value_heads],
                "head_dim": s.head_dim,
                "ffn": s.intermediate_size,
                "vocab": s.vocab_size,
                "tapped": s.num_tapped,
            },
            "trainable_params": bench.model.num_parameters(),
            "batch": {
                "sequences": bench.cfg.optim.batch_sequences,
                "grad_accum": bench.cfg.optim.grad_accum,
                "tokens_per_sequence": bench.seq_len,
                "anchors": bench.cfg.anchors.num_anchors,
                "block": bench.cfg.drafter.block_size,
                "query_tokens": bench.queries,
            },
            "dtype": bench.cfg.run.dtype,
            "head_chunk_tokens": bench.cfg.loss.head_chunk_tokens,
            "compile_chunks": bench.cfg.loss.compile_chunks,
            "cuda_graphs": bench.cfg.run.cuda_graphs,  # the compiled layers' phase only
            "device": torch.cuda.get_device_name(0) if bench.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "not_scoped": missing,
            "data": "synthetic, no loader",
            "setup_s": round(time.perf_counter() - t0, 1),
        }
    )
    phases = {"false": [False], "true": [True], "both": [False, True]}[args.compile_layers]
    steps: dict[bool, dict] = {}
    for compiled in phases:
        try:
            if compiled:
                bench.model.compile_layers(cuda_graphs=bench.cfg.run.cuda_graphs)
            steps[compiled] = bench.measure(args, compiled)
            emit(steps[compiled])
            if args.profile_steps > 0:  # 0: timings only
                trace = args.trace if compiled == phases[0] else None
                emit(bench.profile(args, compiled, trace))
        except Exception as err:  # report, go on with the next phase
            text = str(err).strip().splitlines()
            emit(
                {
                    "what": "train_step",
                    "shape": args.shape,
                    "compile_layers": compiled,
                    "status": "error",
                    "error": f"{type(err).__name__}: {(text[0] if text else '')[:300]}",
                }
            )
    if False in steps and True in steps:
        eager, fused = steps[False], steps[True]
        emit(
            {
                "what": "compile_layers_effect",
                "shape": args.shape,
                "step_ms": [eager["median_step_ms"], fused["median_step_ms"]],
                "speedup": round(eager["median_step_ms"] / fused["median_step_ms"], 3),
                "first_step_s": [eager["first_step_s"], fused["first_step_s"]],
                "peak_gpu_GB": [eager.get("peak_gpu_GB"), fused.get("peak_gpu_GB")],
            }
        )


if __name__ == "__main__":
    main()
