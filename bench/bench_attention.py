"""Benchmark: one drafter layer's anchor-block attention at the seed's shape, on one GPU.

32/8 heads, head dim 128, 128 sorted random anchors x block 16 = 2,048 query tokens, 8,192
context tokens in 8 documents (10,240 KV tokens), bf16. For the project's compiled region
(`stage2_train.attention.block_attention` with the BlockMask built directly from the anchors),
eager flex_attention and SDPA with the same dense mask: peak memory above the inputs and
median time of forward and forward+backward (triton do_bench), error vs an fp32 SDPA reference,
and the cost of building the BlockMask each step. Writes JSON lines to stdout and $OUT.

`--sweep` instead times fwd+bwd of flex_attention's own knobs in compiled regions (BlockMask
tile sizes, kernel_options, anchor orderings; bench/flex_sweep.py), each checked against an fp32
reference, within `--budget-s` seconds ($OUT/attention_sweep.jsonl); `--rounds N` repeats
them N times in the process and ranks by medians. `--device cpu --tiny`
smoke-runs either mode at a tiny shape; on the CPU flex has no backward, so the sweep times
the forward only there (and kernel options are not the Triton ones measured on the GPU).

    python bench/bench_attention.py                        # needs a CUDA GPU
    python bench/bench_attention.py --sweep --budget-s 240 # needs a CUDA GPU
    python bench/bench_attention.py --sweep --device cpu --tiny --only prescale_qk
    python bench/bench_attention.py --sweep --only none --fresh-cache   # the region's kernels
    python bench/bench_attention.py --sweep --only bwd16_m1,bwd16_n2 --rounds 3  # medians
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from flex_check import Problem  # bench/ is on sys.path: scripts run as bench/x.py
from flex_kernels import cached_flex_kernels
from flex_sweep import Sweep
from flex_variants import VARIANTS
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.nn.attention.flex_attention import create_mask, flex_attention

import stage2_train.attention as attention_module
from stage2_train.attention import block_attention, flex_layout
from stage2_train.masks import anchor_block_mask, anchor_block_mask_mod, context_intervals

HQ, HKV, E, CTX, B, A, NUM_DOCS = 32, 8, 128, 8192, 16, 128, 8
Q, KV = A * B, CTX + A * B
RESULTS = "bench_attention.jsonl"


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)  # OUT=$OUT/name: one folder per process in a call
        with open(os.path.join(out, RESULTS), "a") as f:
            f.write(line + "\n")


def use_tiny_shape() -> None:
    """4/2 heads of 32, 16 anchors x 16 over 512 context tokens in 3 documents: CPU seconds."""
    global HQ, HKV, E, CTX, A, NUM_DOCS, Q, KV
    HQ, HKV, E, CTX, A, NUM_DOCS = 4, 2, 32, 512, 16, 3
    Q, KV = A * B, CTX + A * B


def make_timer(dev: str) -> Callable[[Callable[[], object]], float]:
    """Median ms of a call: triton's do_bench on the GPU, a host clock on the CPU."""
    if dev == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")

    def host_median(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return host_median


def inputs(dev: str, dtype: torch.dtype = torch.bfloat16) -> tuple:
    gen = torch.Generator(device="cpu").manual_seed(0)
    cuts = torch.sort(torch.randperm(CTX - 1, generator=gen)[: NUM_DOCS - 1] + 1).values
    doc_S = torch.zeros(CTX, dtype=torch.long)
    for c in cuts.tolist():
        doc_S[c:] += 1
    anchors_A = torch.sort(torch.randperm(CTX - B, generator=gen)[:A] + 1).values

    def rand(*shape: int) -> torch.Tensor:
        # in the layout the project's region hands flex (--layout sets it): heads-major as
        # training's, or tokens-major as the layers' projections write (DFLASH_FLEX_LAYOUT)
        return flex_layout(torch.randn(*shape, device=dev, dtype=dtype))

    q = rand(1, HQ, Q, E).requires_grad_()
    k = rand(1, HKV, KV, E).requires_grad_()
    v = rand(1, HKV, KV, E).requires_grad_()
    grad = rand(1, HQ, Q, E)
    return anchors_A.to(dev), doc_S.to(dev), q, k, v, grad


def peak_and_time(fn, q, k, v, grad, timer) -> dict:
    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        fn().backward(grad)

    fwd_bwd()  # compile / warm up outside the measurement
    torch.cuda.synchronize()
    out = {}
    for name, call in (("fwd", lambda: fn()), ("fwd_bwd", fwd_bwd)):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        out[f"{name}_peak_GB"] = round((torch.cuda.max_memory_allocated() - base) / 1e9, 3)
        out[f"{name}_ms"] = round(timer(call), 3)
    return out


def run_sweep(args: argparse.Namespace) -> None:
    """Flex knobs in compiled regions vs the project's region (bench/flex_sweep.py)."""
    global RESULTS
    RESULTS = "attention_sweep.jsonl"
    dev = args.device
    if args.fresh_cache:  # read lazily by inductor: set before the first compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-sweep-")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    anchors_A, doc_S, q, k, v, grad = inputs(dev, dtype)
    if dev != "cuda":  # flex refuses inputs that require grad on the CPU
        q, k, v = q.detach(), k.detach(), v.detach()
    lo_A, hi_A = context_intervals(anchors_A, doc_S)
    problem = Problem(q, k, v, grad, lo_A, hi_A, CTX, B, anchor_block_mask_mod(lo_A, hi_A, CTX, B))
    emit(
        {
            "what": "sweep_setup",
            # of the inputs, made in the layout the project's region hands flex
            "layout": attention_module.FLEX_LAYOUT,
            "region_layout": attention_module.FLEX_LAYOUT,
            "shape": {"HQ": HQ, "HKV": HKV, "E": E, "CTX": CTX, "A": A, "B": B, "docs": NUM_DOCS},
            "dtype": str(dtype),
            "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
            "torch": torch.__version__,
            "backward": dev == "cuda",
            "budget_s": args.budget_s,
            "note": None
            if dev == "cuda"
            else "CPU: forward only (flex has no CPU backward); "
            "Triton kernel options do not apply to the CPU kernel",
        }
    )
    sweep = Sweep(
        problem,
        make_timer(dev),
        emit,
        backward=dev == "cuda",
        budget_s=args.budget_s * args.rounds,
        variant_timeout_s=args.variant_timeout_s,
    )
    if dev == "cuda":
        emit({"what": "gpu_warm", "seconds": warm_gpu(args.warm_s)})
    chosen = [v for v in VARIANTS if not args.only or v.name in args.only]
    for round_index in range(args.rounds):
        sweep.round = round_index
        sweep.run_baseline()  # first in every round: each round's variants judged against it
        if not args.only or any(name.startswith("order_") for name in args.only):
            sweep.run_orderings()
        if not args.only or any(name.startswith("gqa_packed") for name in args.only):
            sweep.run_gqa_packed()
        # rotated, so that no variant always runs right after the baseline's compile
        shift = round_index % len(chosen) if chosen else 0
        for variant in chosen[shift:] + chosen[:shift]:
            sweep.run_variant(variant)
    summary = sweep.summary()
    emit(summary)
    if args.fresh_cache:  # which kernel configurations this process compiled
        emit({"what": "flex_kernels", "kernels": cached_flex_kernels(cache_dir())})
    print_table(sweep, summary, args.rounds)


def print_table(sweep: Sweep, summary: dict, rounds: int) -> None:
    """The sweep's table: each name's figure (its median over the rounds, with their range
    when there are several) and its speedup against the baseline's."""
    key, spread = summary["metric"], summary["spread"]
    base = summary["baseline_ms"]
    ranged = f"{'min-max':>17}" if rounds > 1 else ""
    print(
        f"\n{'variant':<20} {'status':<8} {'tile':<9} {key:>10} {'speedup':>8} {'valid':>6}{ranged}"
    )
    for name, r in sweep.results.items():
        tile = "x".join(map(str, r.get("tile", []))) or "-"
        figure = spread.get(name)
        ms = figure["median"] if figure else r.get(key, "-")
        speedup = round(base / figure["median"], 3) if figure and base else "-"
        span = f"{figure['min']:>8.4f}-{figure['max']:<8.4f}" if figure and rounds > 1 else ""
        print(
            f"{name:<20} {r.get('status', '-'):<8} {tile:<9} {ms:>10} "
            f"{speedup:>8} {str(r.get('valid', '-')):>6} {span}".rstrip()
        )


def warm_gpu(seconds: float) -> float:
    """bf16 matmuls for `seconds` (then synchronized): the seconds actually spent."""
    t0 = time.perf_counter()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    product = torch.empty_like(a)
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            torch.mm(a, a, out=product)
        torch.cuda.synchronize()
    return round(time.perf_counter() - t0, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time flex's knobs (flex_sweep.py)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="sweep: stop starting variants once this many seconds are spent",
    )
    parser.add_argument("--variant-timeout-s", type=float, default=90.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="sweep: run the baseline and the variants this many times in this process (the "
        "variants' order rotated each round; --budget-s is per round); the summary ranks by "
        "each one's median over the rounds",
    )
    parser.add_argument(
        "--warm-s",
        type=float,
        default=2.0,
        help="sweep on a GPU: seconds of matmuls before the first measurement, so that the "
        "baseline, measured first, does not meet a GPU still raising its clocks",
    )
    parser.add_argument(
        "--fresh-cache",
        action="store_true",
        help="sweep: compile into a new, empty inductor cache folder and report the Triton tiles "
        "of the flex kernels found there (which configuration this process got; "
        "bench/flex_kernels.py)",
    )
    parser.add_argument(
        "--only",
        type=lambda s: s.split(","),
        default=None,
        help="sweep: comma-separated variant names (order_* for the orderings, gqa_packed for the "
        "query heads folded into rows)",
    )
    parser.add_argument(
        "--layout",
        choices=["tokens", "heads"],
        default="heads",
        help="q/k/v in memory, as made and as the project's region hands them to flex: "
        "heads-major ([H, N, E] contiguous, the default, as training's) or tokens-major "
        "([N, H, E], as the layers' projections write them; DFLASH_FLEX_LAYOUT=tokens in "
        "training); the same values either way",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, got {args.rounds}")
    # the layout the project's region hands flex, and so of every input made here
    attention_module.FLEX_LAYOUT = args.layout
    if args.tiny:
        use_tiny_shape()
    if args.sweep:
        run_sweep(args)
    elif args.device == "cuda":
        measure_all()
    else:
        raise SystemExit("the default mode needs a GPU; on the CPU use --sweep --tiny")


def measure_all() -> None:
    dev = "cuda"
    timer = make_timer(dev)
    anchors_A, doc_S, q, k, v, grad = inputs(dev)
    lo_A, hi_A = context_intervals(anchors_A, doc_S)
    mask_mod = anchor_block_mask_mod(lo_A, hi_A, CTX, B)
    dense = create_mask(mask_mod, 1, 1, Q, KV, device=dev)
    ref = F.scaled_dot_product_attention(
        q.detach().float(),
        k.detach().float(),
        v.detach().float(),
        attn_mask=dense,
        enable_gqa=True,
    )

    t0 = time.perf_counter()
    block_mask = anchor_block_mask(lo_A, hi_A, CTX, B)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    build_ms = timer(lambda: anchor_block_mask(lo_A, hi_A, CTX, B))
    emit(
        {
            "what": "block_mask_build",
            "layout": attention_module.FLEX_LAYOUT,
            "region_layout": attention_module.FLEX_LAYOUT,
            "first_call_s": round(first, 3),
            "median_ms": round(build_ms, 3),
            "sparsity_pct": round(block_mask.sparsity(), 1),
            "mask_density_pct": round(100 * dense.float().mean().item(), 2),
        }
    )

    variants = {
        "compiled_region": lambda: block_attention(q, k, v, block_mask),
        "eager_flex": lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True),
        "sdpa_dense": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True
        ),
    }
    for name, fn in variants.items():
        t0 = time.perf_counter()
        try:
            record = peak_and_time(fn, q, k, v, grad, timer)
        except Exception as err:  # report, keep measuring the others
            emit({"what": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        with torch.no_grad():
            err = ((fn().float() - ref).norm() / ref.norm()).item()
        emit(
            {
                "what": name,
                **record,
                "rel_err_vs_fp32": round(err, 5),
                "wall_incl_compile_s": round(time.perf_counter() - t0, 1),
            }
        )


if __name__ == "__main__":
    main()
