"""Benchmark: one drafter layer's anchor-block attention at the seed's shape, on one GPU.

32/8 heads, head dim 128, 128 sorted random anchors x block 16 = 2,048 query tokens, 8,192
context tokens in 8 documents (10,240 KV tokens), bf16. For the project's compiled region
(`stage2_train.attention.block_attention` with the BlockMask built directly from the anchors),
eager flex_attention and SDPA with the same dense mask: peak memory above the inputs and
median time of forward and forward+backward (triton do_bench), error vs an fp32 SDPA reference,
and the cost of building the BlockMask each step. Writes JSON lines to stdout and $OUT.

    python bench/bench_attention.py            # needs a CUDA GPU
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask, flex_attention
from triton.testing import do_bench

from stage2_train.attention import block_attention
from stage2_train.masks import anchor_block_mask, anchor_block_mask_mod, context_intervals

HQ, HKV, E, CTX, B, A, NUM_DOCS = 32, 8, 128, 8192, 16, 128, 8
Q, KV = A * B, CTX + A * B


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_attention.jsonl"), "a") as f:
            f.write(line + "\n")


def inputs(dev: str) -> tuple:
    gen = torch.Generator(device="cpu").manual_seed(0)
    cuts = torch.sort(torch.randperm(CTX - 1, generator=gen)[: NUM_DOCS - 1] + 1).values
    doc_S = torch.zeros(CTX, dtype=torch.long)
    for c in cuts.tolist():
        doc_S[c:] += 1
    anchors_A = torch.sort(torch.randperm(CTX - B, generator=gen)[:A] + 1).values
    mk = dict(device=dev, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, HQ, Q, E, **mk)
    k = torch.randn(1, HKV, KV, E, **mk)
    v = torch.randn(1, HKV, KV, E, **mk)
    grad = torch.randn(1, HQ, Q, E, device=dev, dtype=torch.bfloat16)
    return anchors_A.to(dev), doc_S.to(dev), q, k, v, grad


def peak_and_time(fn, q, k, v, grad) -> dict:
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
        out[f"{name}_ms"] = round(do_bench(call, warmup=25, rep=200, return_mode="median"), 3)
    return out


def main() -> None:
    dev = "cuda"
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
    build_ms = do_bench(
        lambda: anchor_block_mask(lo_A, hi_A, CTX, B), warmup=10, rep=100, return_mode="median"
    )
    emit(
        {
            "what": "block_mask_build",
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
            record = peak_and_time(fn, q, k, v, grad)
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
