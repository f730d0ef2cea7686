"""Gate before a GPU training run: does the project's attention region lower and agree with an
fp32 reference at the pystd drafter's head shape (6/2 heads of 64) on this torch?

The sweep (bench/flex_sweep.py) measures the seed shape (heads of 128); the recipe trains at
head dim 64 and evaluates in fp32, where the 64-token tiles take other kernel tiles
(stage2_train/flex_tiles.py). This runs one sequence of the recipe's shape (3,072 context
tokens in 640-token documents, 512 anchors x 16) through `block_attention`: bf16 forward +
backward and an fp32 forward, each against fp32 SDPA on the dense mask, and times the bf16
forward + backward beside the same call at 128-token tiles with inductor's own kernel tiles
(the region until the fourteenth session). One JSON line on stdout; exit 1 when the region
fails or errs (then train with DFLASH_FLEX_TILE=128):

    python3 bench/flex_gate.py || export DFLASH_FLEX_TILE=128
    python3 bench/flex_gate.py --device cpu   # forward checks only (flex has no CPU backward)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from flex_check import Problem, reference, rel_err  # bench/ is on sys.path

from stage2_train import flex_tiles
from stage2_train.attention import block_attention
from stage2_train.masks import TILE, anchor_block_mask, anchor_block_mask_mod, context_intervals

HQ, HKV, E, CTX, DOC, A, B = 6, 2, 64, 3072, 640, 512, 16
MAX_ERR = 1e-2  # bf16 attention vs fp32: ~2e-3 at the seed shape (BENCHMARKS.md)


def problem(device: torch.device, dtype: torch.dtype) -> Problem:
    g = torch.Generator().manual_seed(0)
    docs_S = (torch.arange(CTX) // DOC).to(device)
    anchors_A = torch.randperm(CTX - 1, generator=g)[:A].sort().values.to(device)
    lo_A, hi_A = context_intervals(anchors_A, docs_S)
    kv = CTX + A * B

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    return Problem(
        q=leaf(1, HQ, A * B, E),
        k=leaf(1, HKV, kv, E),
        v=leaf(1, HKV, kv, E),
        grad=torch.randn(1, HQ, A * B, E, generator=g).to(device, dtype),
        ctx_lo_A=lo_A,
        ctx_hi_A=hi_A,
        context_len=CTX,
        block_size=B,
        mask_mod=anchor_block_mask_mod(lo_A, hi_A, CTX, B),
    )


def check(p: Problem, backward: bool, tile: int) -> dict[str, float]:
    """Relative errors of block_attention on `p` against the fp32 reference."""
    mask = anchor_block_mask(p.ctx_lo_A, p.ctx_hi_A, p.context_len, p.block_size, tile)
    # the evaluations' forward runs without autograd (CPU flex refuses inputs that need grad)
    q, k, v = (p.q, p.k, p.v) if backward else (p.q.detach(), p.k.detach(), p.v.detach())
    out = block_attention(q, k, v, mask)
    errors = {}
    ref = reference(p, backward)
    if backward:
        out.backward(p.grad)
        for name, tensor in (("dq", p.q.grad), ("dk", p.k.grad), ("dv", p.v.grad)):
            errors[name] = rel_err(tensor, ref[name])
    errors["out"] = rel_err(out.detach(), ref["out"])
    return errors


def fwd_bwd_ms(p: Problem, tile: int) -> float:
    from triton.testing import do_bench  # GPU only

    mask = anchor_block_mask(p.ctx_lo_A, p.ctx_hi_A, p.context_len, p.block_size, tile)

    def call() -> None:
        p.q.grad = p.k.grad = p.v.grad = None
        block_attention(p.q, p.k, p.v, mask).backward(p.grad)

    call()  # compile
    return round(do_bench(call), 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    record: dict = {"what": "flex_gate", "torch": torch.__version__, "tile": TILE}
    started = time.perf_counter()
    try:
        record["bf16_err"] = check(problem(device, torch.bfloat16), gpu, TILE)
        record["fp32_err"] = check(problem(device, torch.float32), False, TILE)
        if gpu:
            record["fwd_bwd_ms"] = fwd_bwd_ms(problem(device, torch.bfloat16), TILE)
            torch._dynamo.reset()  # the old region compiles afresh, with inductor's own tiles
            with flex_tiles.inductor_defaults():
                record["fwd_bwd_ms_tile128"] = fwd_bwd_ms(problem(device, torch.bfloat16), 128)
            record["speedup"] = round(record["fwd_bwd_ms_tile128"] / record["fwd_bwd_ms"], 3)
        worst = max(max(record["bf16_err"].values()), max(record["fp32_err"].values()))
        record["ok"] = worst <= MAX_ERR
    except Exception as err:  # a lowering error is the answer this gate exists to give
        record.update(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
    record["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(record), flush=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
