"""Generation throughput of `dflash generate`'s local backend (new tokens/s), on a random-weight
target of a given shape: the batched, length-sorted, KV-cached `generate` that generate runs.

    python bench/bench_generate.py --shape qwen3-8b --prompts 512 --batch-size 256   # GPU
    python bench/bench_generate.py --shape pystd-28m --dtype float32 --equal-lengths \
        --prompts 2048 --new-tokens 384 --batch-size 1024 --profile      # the recipe's shape
    python bench/bench_generate.py --tiny                                             # CPU check

--profile records the timed run with torch.profiler and writes the ops by self device time
(and the share of wall time the device was busy) to $OUT/generate-profile.txt: where a decode
step of the recipe's 28M target goes (fifth/sixth sessions: ~33 ms per step of 1,024 rows,
which neither its FLOPs nor its KV-cache bytes explain).

Random weights write random tokens, so no reply stops early: every prompt gets exactly
--new-tokens, the worst case for time. Prints one JSON line (also to $OUT/generate-bench.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from shapes import PYSTD_28M, QWEN3_8B  # bench/ is on sys.path: scripts run as bench/x.py
from transformers import AutoModelForCausalLM, Qwen3Config

from stage1_generate.config import SamplingConfig
from stage1_generate.local_backend import LocalBackend

SHAPES = {
    "qwen3-8b": QWEN3_8B,
    "pystd-28m": PYSTD_28M,
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="--shape tiny on the CPU (a check)")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=1 << 22)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bf16 on GPU")
    parser.add_argument(
        "--equal-lengths",
        action="store_true",
        help="every prompt exactly --prompt-tokens long (text windows: no padding)",
    )
    parser.add_argument("--profile", action="store_true", help="profile the timed run")
    parser.add_argument(
        "--attn",
        default="sdpa",
        help="the target's attn_implementation (sdpa, eager, sdpa_gqa_decode: decode steps on "
        "the key/value heads)",
    )
    parser.add_argument(
        "--cache",
        choices=["dynamic", "static", "preallocated"],
        default="dynamic",
        help="run.kv_cache (preallocated: written in place, no per-step copy; static: "
        "transformers compiles the decode step on a GPU; the "
        "warm-up runs at the timed batch's shape so that compile is not timed)",
    )
    parser.add_argument(
        "--matmul-precision",
        choices=["highest", "high"],
        default="highest",
        help="high lets fp32 matmuls run as TF32 (faster; near-tie argmaxes, so the text, may "
        "change); the CUDA flag load_target sets for target.matmul_precision",
    )
    args = parser.parse_args()
    # the same switch as load_target's (mixing it with set_float32_matmul_precision makes
    # torch's precision getter raise)
    torch.backends.cuda.matmul.allow_tf32 = args.matmul_precision == "high"
    if args.attn == "sdpa_gqa_decode":  # registers it with transformers
        from stage1_generate import gqa_decode  # noqa: F401
    shape = "tiny" if args.tiny else args.shape
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else default
    config = Qwen3Config(**{**SHAPES[shape], "max_position_embeddings": 8192}, pad_token_id=0)
    torch.manual_seed(0)
    with device:  # initialised where it runs: an 8B model never passes through host memory
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=args.attn
        ).eval()
    # a reserved id as the stop id, never sampled by argmax in practice: replies run full length
    backend = LocalBackend(
        model,
        # random ids need no vocabulary: a stand-in with what the backend reads
        SimpleNamespace(pad_token_id=0, decode=lambda ids, **_: ""),  # type: ignore[arg-type]
        SamplingConfig(),
        [config.vocab_size - 1],
        args.batch_size,
        args.batch_tokens,
        kv_cache=args.cache,
    )
    gen = torch.Generator().manual_seed(0)
    low = args.prompt_tokens if args.equal_lengths else args.prompt_tokens // 2
    lengths = torch.randint(low, args.prompt_tokens + 1, (args.prompts,), generator=gen)
    prompts = [
        torch.randint(1, config.vocab_size - 1, (n,), generator=gen).tolist() for n in lengths
    ]
    # warm-up: kernels, allocator; a static cache compiles per batch shape and keeps the
    # longest length it has seen, so its warm-up runs the first batch the timed run plans (the
    # longest prompts) with the same new tokens
    longest = sorted(prompts, key=len, reverse=True)
    warm = longest[: args.batch_size] if args.cache == "static" else prompts[:8]
    backend.generate(warm, args.new_tokens if args.cache == "static" else 4)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    profiler = _profiler(device) if args.profile else contextlib.nullcontext()
    with profiler:
        start = time.perf_counter()
        completions = backend.generate(prompts, args.new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    new = sum(c.num_tokens for c in completions)
    result = {
        "bench": "generate",
        "shape": shape,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": args.prompts,
        "prompt_tokens": f"{low}-{args.prompt_tokens}",
        "new_tokens_each": args.new_tokens,
        "batch_size": args.batch_size,
        "new_tokens": new,
        "seconds": round(seconds, 2),
        "new_tokens_per_s": round(new / seconds, 1),
        "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)
        if device.type == "cuda"
        else None,
        "attn": args.attn,
        "kv_cache": args.cache,
        "matmul_precision": args.matmul_precision,
        "torch": torch.__version__,
    }
    if args.profile:
        result["device_busy_share"] = _write_profile(profiler, device, seconds)
    print(json.dumps(result))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "generate-bench.json").write_text(json.dumps(result) + "\n")


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _write_profile(profiler: torch.profiler.profile, device: torch.device, seconds: float) -> float:
    """Write the op table to $OUT/generate-profile.txt (or ./); return device-busy / wall."""
    events = profiler.key_averages()
    if device.type == "cuda":
        sort, busy_us = "self_cuda_time_total", sum(e.self_device_time_total for e in events)
    else:
        sort, busy_us = "self_cpu_time_total", sum(e.self_cpu_time_total for e in events)
    table = events.table(sort_by=sort, row_limit=30)
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate-profile.txt").write_text(table + "\n")
    return round(busy_us / 1e6 / seconds, 3)


if __name__ == "__main__":
    main()
