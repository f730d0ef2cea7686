"""Benchmark: where one `dflash train` optimizer step spends its GPU time (issue 12).

Synthetic packed sequences (random tokens, documents of ~1/8 to ~3/10 of a sequence with a
16-token prompt carrying no loss, random bf16 features) go through the project's own path:
items shaped like `StoreSequences`' (project anchor sampling and block labels) ->
`stage2_train.data.collate` -> `StepRunner.step` (batch to the device, `forward_batch` with the
compiled-region flex attention and its per-step BlockMask, the chunked LM-head loss, backward,
clipping, fused AdamW), at the pystd recipe's shape (configs/pystd.yaml: 8 sequences x 3,072
tokens per step, 512 anchors x 16 each, `mixed`) or the Qwen3-8B drafter's
(configs/qwen3-8b.yaml; bench/shapes.py). There is no loader: reading and decoding the store
is not in these figures (bench/bench_train.py times the real loop from a store).

For run.compile_layers=false, then true (same process, same batches; `--compile-layers`):
median step time over `--steps` after `--warmup`, tokens/s, model TFLOP/s and MFU counted as in
bench_train.py, peak memory, first-step time; then torch.profiler over `--profile-steps` steps:
GPU kernel time per step by category (attention fwd/bwd, mask build, LM head + loss, matmuls
fwd/bwd, optimizer + clipping, copies, other fwd/bwd), the share of the step the GPU is busy,
and the top kernels. Categories come from record_function scopes this script wraps around
BlockAttention's construction (mask build), block_attention (attention) and chunked_block_loss
(loss), plus kernel and autograd-node names. JSON lines to stdout and
$OUT/train_profile.jsonl; `--trace F` also writes a gzipped Chrome trace of the first phase.

    python bench/profile_train_step.py --shape pystd                  # needs a CUDA GPU
    python bench/profile_train_step.py --shape qwen3-8b --compile-layers false
    python bench/profile_train_step.py --shape tiny --device cpu      # CPU smoke: ops' CPU time
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from bench_train import MATRIX_RATE, model_flops  # bench/ is on sys.path: scripts run as bench/x.py
from shapes import PYSTD_28M, QWEN3_8B
from torch.autograd.profiler import record_function

import stage2_train.attention as attention_module
import stage2_train.step as step_module
import stage2_train.trainstep as trainstep_module
from common.config import build_config
from stage2_train.anchors import block_labels, pad_anchors, sample_anchors, training_slot_weights
from stage2_train.config import TrainConfig
from stage2_train.data import Batch, collate
from stage2_train.fp8 import convert_to_fp8
from stage2_train.model import DFlashDrafter, drafter_shape
from stage2_train.step import FrozenHead
from stage2_train.trainstep import StepRunner, run_dtypes

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
# config file, target config, tapped layers, tokens per sequence, mask token id, extra settings
SHAPES: dict[str, tuple[str, dict, int, int, int, list[str]]] = {
    "pystd": ("configs/pystd.yaml", PYSTD_28M, 5, 3072, 3, []),
    "qwen3-8b": ("configs/qwen3-8b.yaml", QWEN3_8B, 5, 3072, 151669, []),
    "tiny": ("configs/debug.yaml", TINY, 2, 256, 3, ["optim.batch_sequences=2"]),
}
ROOT = Path(__file__).resolve().parents[1]
PROMPT = 16  # first tokens of each synthetic document carry no loss
CATEGORIES = (
    "attention_fwd",
    "attention_bwd",
    "mask_build",
    "lm_head_loss",
    "matmul_fwd",
    "matmul_bwd",
    "optimizer",
    "copies",
    "other_fwd",
    "other_bwd",
)
MATMUL_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "splitk", "gemv")  # cuBLAS
MATMUL_OPS = ("mm", "addmm", "bmm", "matmul", "linear")  # the CPU smoke's op names
COPY_NAMES = ("memcpy", "memset", "copy", "catarraybatched")


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "train_profile.jsonl", "a") as f:
            f.write(line + "\n")


def synthetic_item(
    seq_len: int, tapped: int, hidden: int, vocab: int, cfg: TrainConfig, gen: torch.Generator
) -> dict[str, Any]:
    """One sequence as StoreSequences.__getitem__ returns it (label target: the data tokens)."""
    lo, hi = max(PROMPT + 8, seq_len // 8), max(PROMPT + 16, seq_len * 3 // 10)
    document_ids_S = torch.full((seq_len,), -1, dtype=torch.long)
    position_ids_S = torch.zeros(seq_len, dtype=torch.long)
    loss_mask_S = torch.zeros(seq_len, dtype=torch.bool)
    start, doc = 0, 0
    while seq_len - start >= lo:  # packed documents, the tail left as padding
        length = min(int(torch.randint(lo, hi + 1, (), generator=gen)), seq_len - start)
        document_ids_S[start : start + length] = doc
        position_ids_S[start : start + length] = torch.arange(length)
        loss_mask_S[start + PROMPT : start + length] = True
        start, doc = start + length, doc + 1
    tokens_S = torch.randint(4, vocab, (seq_len,), generator=gen)
    num_anchors, block_size = cfg.anchors.num_anchors, cfg.drafter.block_size
    sampled_A = sample_anchors(loss_mask_S, document_ids_S, num_anchors, gen)
    anchors_A = pad_anchors(sampled_A, num_anchors)
    labels_AB, weights_AB = block_labels(
        anchors_A, tokens_S, loss_mask_S, document_ids_S, None, block_size
    )
    return {
        "index": 0,
        "tokens_S": tokens_S,
        "position_ids_S": position_ids_S,
        "document_ids_S": document_ids_S,
        "hidden_SKD": torch.randn(seq_len, tapped, hidden, generator=gen, dtype=torch.bfloat16),
        "anchors_A": anchors_A,
        "labels_AB": labels_AB,
        "weights_AB": weights_AB.float(),
        "damaged": None,
    }


def instrument() -> list[str]:
    """record_function scopes around the mask build, the attention and the loss (for the
    profile's categories); returns what could not be wrapped (those then count by name)."""
    missing = []
    if hasattr(step_module, "BlockAttention"):

        class ScopedBlockAttention(step_module.BlockAttention):  # type: ignore[name-defined,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                with record_function("dflash::mask_build"):
                    super().__init__(*args, **kwargs)

        step_module.BlockAttention = ScopedBlockAttention  # type: ignore[misc]
    else:
        missing.append("stage2_train.step.BlockAttention (mask build)")
    if hasattr(attention_module, "block_attention"):
        attend = attention_module.block_attention

        @torch.compiler.disable  # like the original: compiled layers call it from eager code
        def scoped_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function("dflash::attention"):
                return attend(*args, **kwargs)

        attention_module.block_attention = scoped_attention
    else:
        missing.append("stage2_train.attention.block_attention (attention forward)")
    if hasattr(trainstep_module, "chunked_block_loss"):
        loss_fn = trainstep_module.chunked_block_loss

        def scoped_loss(*args: Any, **kwargs: Any) -> Any:
            with record_function("dflash::loss"):
                return loss_fn(*args, **kwargs)

        trainstep_module.chunked_block_loss = scoped_loss
    else:
        missing.append("stage2_train.trainstep.chunked_block_loss (LM head + loss)")
    return missing


def classify(name: str, scopes: list[str], compiled_layers: bool) -> str:
    """Category of one kernel (or CPU op) from its name and its enclosing ops' names."""
    lowered, joined = name.lower(), " | ".join(scopes)
    backward = "Backward" in joined or "autograd::engine" in joined
    if "dflash::mask_build" in joined:
        return "mask_build"
    if "dflash::loss" in joined or "ChunkedHeadLoss" in joined:
        return "lm_head_loss"
    attention = (
        "attention" in lowered  # flex's kernels and ops; SDPA's (the CPU backend)
        or lowered.startswith("triton_tem")
        or "dflash::attention" in joined
        or (not compiled_layers and "CompiledFunction" in joined)  # the only compiled region
    )
    if attention:
        return "attention_bwd" if backward else "attention_fwd"
    if "Optimizer." in joined or "multi_tensor" in lowered or "foreach" in lowered:
        return "optimizer"
    if any(n in lowered for n in COPY_NAMES):
        return "copies"
    if any(n in lowered for n in MATMUL_NAMES) or lowered.split("::")[-1] in MATMUL_OPS:
        return "matmul_bwd" if backward else "matmul_fwd"
    return "other_bwd" if backward else "other_fwd"


def _scopes(event: Any) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def breakdown(prof: Any, steps: int, compiled_layers: bool, on_cuda: bool) -> dict[str, Any]:
    """ms per step by category and the top kernels: GPU kernel time on CUDA, else every CPU
    op's self time (a smoke of the same bookkeeping)."""
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list] = {}
    for event in prof.events():
        if on_cuda:
            items = [(k.name, k.duration) for k in event.kernels]
        elif event.device_type == torch.autograd.DeviceType.CPU and not event.is_async:
            items = [(event.name, event.self_cpu_time_total)]
        else:
            items = []
        if not items:
            continue
        scopes = _scopes(event)
        for name, us in items:
            category = classify(name, scopes, compiled_layers)
            per_cat[category] += us
            entry = per_kernel.setdefault(name, [0.0, 0, category])
            entry[0] += us
            entry[1] += 1
    total = sum(per_cat.values()) or 1.0
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    return {
        "kernel_ms_per_step": round(total / steps / 1e3, 3),
        "categories": {
            c: {
                "ms_per_step": round(per_cat[c] / steps / 1e3, 3),
                "share": round(per_cat[c] / total, 4),
            }
            for c in CATEGORIES
            if c in per_cat
        },
        "top_kernels": [
            {
                "name": name[:160],
                "category": cat,
                "ms_per_step": round(us / steps / 1e3, 3),
                "calls_per_step": round(n / steps, 1),
            }
            for name, (us, n, cat) in top
        ],
    }


class Bench:
    """One shape: model, frozen head, StepRunner and a few synthetic batches."""

    def __init__(self, args: argparse.Namespace) -> None:
        config, target, tapped, seq_len, mask_id, extra = SHAPES[args.shape]
        self.device = torch.device(args.device)
        self.cfg = build_config(
            TrainConfig,
            ROOT / config,
            "train",
            ["data.store=synthetic", "run.out=unused", *extra, *args.overrides],
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
        gen = torch.Generator().manual_seed(0)
        per_batch = cfg.optim.batch_sequences
        self.batches: list[Batch] = []
        for _ in range(args.num_batches):
            items = [
                synthetic_item(seq_len, tapped, hidden, vocab, cfg, gen) for _ in range(per_batch)
            ]
            batch = collate(items)
            self.batches.append(batch.pin_memory() if self.device.type == "cuda" else batch)
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
    parser.add_argument("--profile-steps", type=int, default=10)
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
                bench.model.compile_layers()
            steps[compiled] = bench.measure(args, compiled)
            emit(steps[compiled])
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
