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

    python3 bench/flex_gate.py > gate.json || export DFLASH_FLEX_TILE=128
    python3 bench/flex_gate.py --device cpu   # forward checks only (flex has no CPU backward)

It also runs the narrow tile tables (stage2_train/masks.py, the default) on the same shapes
laid out as a batch of 4 sequences: bf16 forward + backward and an fp32 forward with narrow
tables must equal the full tables' bitwise, and the bf16 pair is timed. That verdict is
`narrow_ok`, apart from the exit status (a narrow failure says build full tables, not change
the tile):

    grep -q '"narrow_ok": true' gate.json || export DFLASH_NARROW_MASK=0

On the CPU the narrow tables are widened back before flex (its CPU lowering asserts the full
width), so there the case checks the widening only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from flex_check import Problem, reference, rel_err  # bench/ is on sys.path
from torch.nn.attention.flex_attention import BlockMask

from stage2_train import flex_tiles
from stage2_train.attention import block_attention, tokens_major
from stage2_train.mask_widths import narrow_widths
from stage2_train.masks import (
    TILE,
    MaskTables,
    anchor_block_mask,
    anchor_block_mask_mod,
    anchor_mask_tables,
    block_mask_from_tables,
    context_intervals,
)

HQ, HKV, E, CTX, DOC, A, B = 6, 2, 64, 3072, 640, 512, 16
SEQS = 4  # the narrow case: CTX and A split into 4 sequences side by side, as collate lays them
MAX_ERR = 1e-2  # bf16 attention vs fp32: ~2e-3 at the seed shape (BENCHMARKS.md)
GRADS = ("dq", "dk", "dv")


def problem(device: torch.device, dtype: torch.dtype) -> Problem:
    """One sequence of CTX tokens in documents of DOC, A sorted anchors."""
    g = torch.Generator().manual_seed(0)
    docs_S = torch.arange(CTX) // DOC
    anchors_A = torch.randperm(CTX - 1, generator=g)[:A].sort().values
    return _problem(docs_S, anchors_A, g, device, dtype)


def packed_problem(device: torch.device, dtype: torch.dtype) -> Problem:
    """The same shapes as SEQS sequences laid end to end (documents of DOC restart in each,
    A / SEQS sorted anchors per sequence): the layout `narrow_widths` bounds."""
    g = torch.Generator().manual_seed(1)
    seq_len, pos_S = CTX // SEQS, torch.arange(CTX)
    docs_S = pos_S // seq_len * CTX + pos_S % seq_len // DOC  # ids unique across sequences
    anchors_A = torch.cat(
        [
            j * seq_len + torch.randperm(seq_len - 1, generator=g)[: A // SEQS].sort().values
            for j in range(SEQS)
        ]
    )
    return _problem(docs_S, anchors_A, g, device, dtype)


def _problem(
    docs_S: torch.Tensor,
    anchors_A: torch.Tensor,
    g: torch.Generator,
    device: torch.device,
    dtype: torch.dtype,
) -> Problem:
    lo_A, hi_A = context_intervals(anchors_A.to(device), docs_S.to(device))
    kv = CTX + A * B

    def leaf(*shape: int) -> torch.Tensor:  # as the layers' projections write q/k/v
        return tokens_major(torch.randn(*shape, generator=g).to(device, dtype)).requires_grad_()

    return Problem(
        q=leaf(1, HQ, A * B, E),
        k=leaf(1, HKV, kv, E),
        v=leaf(1, HKV, kv, E),
        grad=tokens_major(torch.randn(1, HQ, A * B, E, generator=g).to(device, dtype)),
        ctx_lo_A=lo_A,
        ctx_hi_A=hi_A,
        context_len=CTX,
        block_size=B,
        mask_mod=anchor_block_mask_mod(lo_A, hi_A, CTX, B),
    )


def run(p: Problem, mask: BlockMask, backward: bool) -> dict[str, torch.Tensor]:
    """block_attention's output on `p` and, with backward, the input gradients."""
    # the evaluations' forward runs without autograd (CPU flex refuses inputs that need grad)
    q, k, v = (p.q, p.k, p.v) if backward else (p.q.detach(), p.k.detach(), p.v.detach())
    p.q.grad = p.k.grad = p.v.grad = None
    out = block_attention(q, k, v, mask)
    if not backward:
        return {"out": out}
    out.backward(p.grad)
    return {"out": out.detach(), "dq": p.q.grad, "dk": p.k.grad, "dv": p.v.grad}


def tile_mask(p: Problem, tile: int) -> tuple[Problem, BlockMask]:
    """`p` and its BlockMask at `tile`-token tiles (full tables, built on p's device)."""
    return p, anchor_block_mask(p.ctx_lo_A, p.ctx_hi_A, p.context_len, p.block_size, tile)


def check(p: Problem, backward: bool, tile: int) -> dict[str, float]:
    """Relative errors of block_attention on `p` against the fp32 reference."""
    got, ref = run(*tile_mask(p, tile), backward), reference(p, backward)
    return {name: rel_err(got[name], ref[name]) for name in (*GRADS, "out") if name in got}


def narrow_check(p: Problem, backward: bool) -> dict:
    """Narrow tables against full ones on `p` (a packed_problem): the results' largest
    difference (0: bitwise equal), the narrow results' errors against fp32, and on a GPU
    both timed. The tables are built on the CPU, as collate builds them."""
    widths = narrow_widths(SEQS, CTX // SEQS, A // SEQS, B, TILE)
    masks, results = {}, {}
    for name, width in (("full", None), ("narrow", widths)):
        tables = anchor_mask_tables(p.ctx_lo_A.cpu(), p.ctx_hi_A.cpu(), CTX, B, widths=width)
        tables = MaskTables(*(t.to(p.q.device) for t in tables))
        masks[name] = block_mask_from_tables(tables, CTX, B)
        results[name] = run(p, masks[name], backward)
    diff = {
        key: (results["narrow"][key].float() - value.float()).abs().max().item()
        for key, value in results["full"].items()
    }
    ref = reference(p, backward)
    record = {
        "widths": list(widths),
        "grid": list(masks["full"].kv_indices.shape[-2:]),
        "max_abs_diff": diff,
        "err": {key: rel_err(value, ref[key]) for key, value in results["narrow"].items()},
    }
    if p.q.device.type == "cuda":
        record["fwd_bwd_ms_full"] = fwd_bwd_ms(p, masks["full"])
        record["fwd_bwd_ms_narrow"] = fwd_bwd_ms(p, masks["narrow"])
    else:
        record["note"] = "cpu: narrow tables widened back (flex's CPU lowering needs full width)"
    return record


def narrow_verdict(device: torch.device) -> dict:
    """`narrow_check` on the packed problem, bf16 (backward on a GPU) and an fp32 forward (the
    evaluations' kernel: other tiles), and its verdict, `narrow_ok`: both bitwise equal to the
    full tables and within MAX_ERR of fp32; an error is a failed verdict, not a failed gate."""
    try:
        narrow = narrow_check(packed_problem(device, torch.bfloat16), device.type == "cuda")
        narrow_fp32 = narrow_check(packed_problem(device, torch.float32), False)
    except Exception as err:
        return {"narrow_ok": False, "narrow_error": f"{type(err).__name__}: {str(err)[:300]}"}
    ok = all(
        max(r["max_abs_diff"].values()) == 0 and max(r["err"].values()) <= MAX_ERR
        for r in (narrow, narrow_fp32)
    )
    return {"narrow": narrow, "narrow_fp32": narrow_fp32, "narrow_ok": ok}


def fwd_bwd_ms(p: Problem, mask: BlockMask) -> float:
    from triton.testing import do_bench  # GPU only

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
            record["fwd_bwd_ms"] = fwd_bwd_ms(*tile_mask(problem(device, torch.bfloat16), TILE))
        record.update(narrow_verdict(device))  # before the reset below: the same region
        if gpu:
            torch._dynamo.reset()  # the old region compiles afresh, with inductor's own tiles
            with flex_tiles.inductor_defaults():
                p = problem(device, torch.bfloat16)
                record["fwd_bwd_ms_tile128"] = fwd_bwd_ms(*tile_mask(p, 128))
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
