"""Benchmark: the LM head's per-chunk post-processing of extraction, eager vs compiled.

At Qwen3-8B's head shape (hidden 4096, vocab 151,936, bf16, random weights) over one batch of
`tokens` valid tokens in chunks of `chunk` rows (the last one shorter, as most batches end),
times stage1_extract.head_stats.head_chunk_stats (argmax, top-k, log-sum-exp) eager and
compiled (verifier.compile_head), and the plain ops it replaced (argmax, topk, logsumexp of an
fp32 copy: `post_plain_ops_ms`), on logits computed beforehand, then the head as
TappedTarget._head runs it (matmul + post-processing per chunk); reports ms per batch, the
ratios, the extra memory of the post-processing (eager's fp32 [chunk, vocab] temporary), and
whether both agree with plain torch ops (argmax, topk values, logsumexp of the fp32 copy).
Part of bench/bench_extract.py (`--head-only` runs just this part); alone, e.g. on a CPU:

    python bench/head_post.py [--device cuda] [--tokens 11776] [--chunk 1024] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from stage1_extract.head_stats import head_chunk_stats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms_per_batch(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    for _ in range(2):  # warm-up (the compiled graphs exist already)
        run()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    _sync(device)
    return (time.perf_counter() - t0) / repeats * 1e3


def _extra_gb(run: Callable[[], None], device: torch.device) -> float | None:
    """Peak memory one batch adds above what is allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    _sync(device)
    return round((torch.cuda.max_memory_allocated(device) - base) / 1e9, 3)


def _plain_stats(raw_CV: torch.Tensor, topk: int) -> None:
    """The post-processing before head_stats.py: argmax, topk, logsumexp of an fp32 copy."""
    raw_CV.argmax(-1)
    raw_CV.topk(topk, dim=-1)
    torch.logsumexp(raw_CV.float(), dim=-1)


def _agreement(raw_CV: torch.Tensor, topk: int, compiled: bool) -> dict:
    """One chunk's results against plain torch ops on the fp32 copy."""
    argmax_C, ids_Ck, vals_Ck, lse_C = head_chunk_stats(raw_CV, topk, len(raw_CV), compiled)
    z_CV = raw_CV.float()
    top = z_CV.topk(topk, dim=-1)
    lse_ref_C = torch.logsumexp(z_CV, dim=-1)
    return {
        "argmax_mismatched_rows": int((argmax_C != z_CV.argmax(-1)).sum()),
        "topk_values_equal": bool(torch.equal(vals_Ck, top.values)),
        "topk_ids_hold_values": bool(torch.equal(z_CV.gather(1, ids_Ck), vals_Ck)),
        "lse_max_abs_diff": float((lse_C - lse_ref_C).abs().max()),
    }


def time_head_post(
    device: torch.device,
    tokens: int,
    chunk: int,
    topk: int,
    hidden: int = 4096,
    vocab: int = 151936,
    repeats: int = 10,
) -> dict:
    """Eager vs compiled post-processing of one batch's LM-head chunks; one JSON record."""
    g = torch.Generator(device).manual_seed(0)
    # a final-normed hidden state and a head of the usual init scale: logits of std ~1.3
    final_ND = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(head.weight, std=0.02, generator=g)
    bounds = [(lo, min(lo + chunk, tokens)) for lo in range(0, tokens, chunk)]
    with torch.inference_mode():
        full_CV = head(final_ND[:chunk])
        tail_rows = tokens % chunk
        tail_CV = head(final_ND[:tail_rows]) if tail_rows else None

        def post(compiled: bool | None) -> Callable[[], None]:
            """None: the plain ops the extraction ran before (the baseline)."""

            def run() -> None:
                for lo, hi in bounds:
                    raw_CV = full_CV if hi - lo == chunk else tail_CV
                    if compiled is None:
                        _plain_stats(raw_CV, topk)
                    else:
                        head_chunk_stats(raw_CV, topk, chunk, compiled)

            return run

        def whole_head(compiled: bool) -> Callable[[], None]:
            def run() -> None:
                for lo, hi in bounds:
                    head_chunk_stats(head(final_ND[lo:hi]), topk, chunk, compiled)

            return run

        def matmul() -> None:
            for lo, hi in bounds:
                head(final_ND[lo:hi])

        t0 = time.perf_counter()
        post(True)()  # compiles the full-chunk graph and the tail's
        _sync(device)
        compile_s = time.perf_counter() - t0
        plain_ms = _ms_per_batch(post(None), device, repeats)
        eager_ms = _ms_per_batch(post(False), device, repeats)
        compiled_ms = _ms_per_batch(post(True), device, repeats)
        matmul_ms = _ms_per_batch(matmul, device, repeats)
        head_eager_ms = _ms_per_batch(whole_head(False), device, repeats)
        head_compiled_ms = _ms_per_batch(whole_head(True), device, repeats)
        record = {
            "what": "head_post",
            "device": str(device),
            "torch": torch.__version__,
            "tokens": tokens,
            "chunk": chunk,
            "chunks": len(bounds),
            "tail_rows": tail_rows,
            "vocab": vocab,
            "hidden": hidden,
            "topk": topk,
            "compile_s": round(compile_s, 1),
            "post_plain_ops_ms": round(plain_ms, 2),
            "post_eager_ms": round(eager_ms, 2),
            "post_compiled_ms": round(compiled_ms, 2),
            "post_ratio_eager_over_compiled": round(eager_ms / compiled_ms, 3),
            "post_ratio_plain_ops_over_compiled": round(plain_ms / compiled_ms, 3),
            "head_matmul_ms": round(matmul_ms, 2),
            "head_eager_ms": round(head_eager_ms, 2),
            "head_compiled_ms": round(head_compiled_ms, 2),
            "head_ratio_eager_over_compiled": round(head_eager_ms / head_compiled_ms, 3),
            "post_plain_ops_extra_GB": _extra_gb(post(None), device),
            "post_eager_extra_GB": _extra_gb(post(False), device),
            "post_compiled_extra_GB": _extra_gb(post(True), device),
            "eager_vs_plain_ops": _agreement(full_CV, topk, compiled=False),
            "compiled_vs_plain_ops": _agreement(full_CV, topk, compiled=True),
        }
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tokens",
        type=int,
        default=11776,
        help="valid tokens of one batch (default: Qwen3-8B's 12,288-token budget less half a "
        "chunk, so the batch ends on a short chunk)",
    )
    parser.add_argument("--chunk", type=int, default=1024, help="verifier.head_chunk_tokens")
    parser.add_argument("--topk", type=int, default=32, help="verifier.topk")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    record = time_head_post(
        torch.device(args.device),
        args.tokens,
        args.chunk,
        args.topk,
        args.hidden,
        args.vocab,
        args.repeats,
    )
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
