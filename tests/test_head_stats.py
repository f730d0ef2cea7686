"""The LM-head chunk statistics of extraction (stage1_extract/head_stats.py) against plain fp32
torch ops, eager and compiled (inductor on the CPU here), ties included, and the whole
extraction's output against the code it replaced.

Tolerance of the log-sum-exp: eager is bit for bit torch.logsumexp of the fp32 copy; compiled,
inductor sums the vocabulary in another order with its own vectorised exp, which moved it by
<= 1e-6 relative on these rows; 1e-5 leaves room for other CPUs, while a real slip (a wrong
shift, a missed column, no fp32 accumulation over 5,000 bf16 terms) moves it by > 1e-3.

Legend: N rows, C rows of one chunk, V vocabulary, k top-k, D hidden.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from transformers import AutoModelForCausalLM

from common.config import build_config
from common.store import open_store
from common.tiny import EXAMPLE_DATA
from stage1_extract.config import ExtractConfig
from stage1_extract.head_stats import (
    _tail_chunk_stats,
    argmax_from_topk,
    chunk_stats,
    head_chunk_stats,
)
from stage1_extract.run import run_extract
from stage1_extract.target import BatchOutput, TappedTarget

N, C, V, K = 150, 64, 5000, 8  # two full chunks and a short one of 22 rows
LSE_TOL = dict(rtol=1e-5, atol=1e-5)
DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


def random_logits(seed: int = 0) -> torch.Tensor:
    """bf16 logits with a real head's spread; bf16 rounding makes ties among the top values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, V, generator=g) * 3).to(torch.bfloat16)


def tied_logits() -> torch.Tensor:
    """Rows whose maximum repeats: 2-way (the later copy first in memory order or not), more
    ways than k, k ways exactly, a constant row, NaN, +inf, all -inf, signed zeros."""
    rows = torch.randn(12, V).to(torch.bfloat16)
    rows[0, [7, 4000]] = 9.0
    rows[1, [4000, 7, 4999]] = 9.0
    rows[2, torch.arange(100, 100 + 3 * K, 3)] = 9.0  # 3k ways: more than k are maximal
    rows[3, torch.arange(50, 50 + K)] = 9.0  # exactly k ways
    rows[4] = 1.5
    rows[5, [10, 20]] = float("nan")
    rows[6, [3, 2000]] = float("inf")
    rows[7] = float("-inf")
    rows[8] = 0.0
    rows[8, :5] = -0.0
    rows[9, [0, V - 1]] = 9.0  # the first and the last column
    rows[10, 4000] = 9.0  # one maximum, no tie
    rows[11, torch.arange(0, V, 2)] = float("nan")
    return rows


def reference(raw_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Plain fp32 torch ops on the fp32 copy: what the stored values mean."""
    z_NV = raw_NV.float()
    top = z_NV.topk(k, dim=-1)
    return z_NV.argmax(-1), top.indices, top.values, torch.logsumexp(z_NV, dim=-1)


def check_topk(raw_NV: torch.Tensor, ids_Nk: torch.Tensor, vals_Nk: torch.Tensor) -> None:
    """The k largest values, at distinct ids that hold them (tied ids may come in any order)."""
    _, _, ref_vals, _ = reference(raw_NV, ids_Nk.shape[1])
    assert vals_Nk.dtype == torch.float32
    torch.testing.assert_close(vals_Nk, ref_vals, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(
        raw_NV.float().gather(1, ids_Nk), vals_Nk, rtol=0, atol=0, equal_nan=True
    )
    assert (ids_Nk.sort(-1).values.diff(dim=-1) > 0).all(), "top-k ids repeat"


def chunked(raw_NV: torch.Tensor, compiled: bool) -> tuple[torch.Tensor, ...]:
    """head_chunk_stats over chunks of C rows, as TappedTarget._head runs them."""
    with torch.inference_mode():
        parts = [
            head_chunk_stats(raw_NV[lo : lo + C].clone(), K, C, compiled)
            for lo in range(0, len(raw_NV), C)
        ]
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


def test_eager_equals_plain_ops() -> None:
    raw_NV = random_logits()
    argmax_N, ids_Nk, vals_Nk, lse_N = chunked(raw_NV, compiled=False)
    ref_argmax, _, _, ref_lse = reference(raw_NV, K)
    assert torch.equal(argmax_N, ref_argmax)
    check_topk(raw_NV, ids_Nk, vals_Nk)
    # today's stored log-sum-exp to the bit, not only to fp32 rounding
    assert torch.equal(lse_N, torch.logsumexp(raw_NV.float(), dim=-1))
    torch.testing.assert_close(lse_N, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("k", [1, 2, K])
def test_eager_ties_give_the_first_maximal_index(k: int) -> None:
    raw_NV = tied_logits()
    argmax_N, ids_Nk, vals_Nk, lse_N = chunk_stats(raw_NV, k)
    assert torch.equal(argmax_N, raw_NV.float().argmax(-1))
    assert argmax_N[:4].tolist() == [7, 7, 100, 50]
    check_topk(raw_NV, ids_Nk, vals_Nk)
    ref_lse = torch.logsumexp(raw_NV.float(), dim=-1)
    torch.testing.assert_close(lse_N, ref_lse, rtol=0, atol=0, equal_nan=True)


def test_argmax_from_topk_whatever_order_topk_gives_ties() -> None:
    """topk's order among ties is not specified: every order of the tied ids gives argmax."""
    raw_NV = tied_logits()[:4]
    vals_Nk, ids_Nk = raw_NV.topk(K, dim=-1)
    for shift in range(K):
        rolled = ids_Nk.roll(shift, dims=1)  # values of rows 2-3 all tie: any order is valid
        rolled[:2] = ids_Nk[:2, [1, 0, *range(2, K)]]  # the two tied ids swapped
        got = argmax_from_topk(raw_NV, vals_Nk, rolled)
        assert got.tolist() == [7, 7, 100, 50]


@pytest.mark.slow
def test_compiled_equals_plain_ops_and_compiles_once_per_shape() -> None:
    torch._dynamo.reset()
    try:
        raw_NV = random_logits(seed=1)
        argmax_N, ids_Nk, vals_Nk, lse_N = chunked(raw_NV, compiled=True)
        ref_argmax, _, _, ref_lse = reference(raw_NV, K)
        assert torch.equal(argmax_N, ref_argmax)
        check_topk(raw_NV, ids_Nk, vals_Nk)
        torch.testing.assert_close(lse_N, ref_lse, **LSE_TOL)

        # inductor's argmax keeps the first maximal index on ties, NaN included
        tied = torch.cat([tied_logits(), tied_logits()[:10]])  # 22 rows: the tail's graph
        argmax_T, ids_Tk, vals_Tk, lse_T = chunked(tied, compiled=True)
        assert torch.equal(argmax_T, tied.float().argmax(-1))
        check_topk(tied, ids_Tk, vals_Tk)
        ref_lse = torch.logsumexp(tied.float(), dim=-1)
        torch.testing.assert_close(lse_T, ref_lse, **LSE_TOL, equal_nan=True)

        # later batches end on other short chunks: no recompile, except the one-row chunk
        for rows in (C + 17, C + 40, C + 1):
            chunked(random_logits(seed=rows)[:rows], compiled=True)
        assert len(_debug_get_cache_entry_list(chunk_stats.__code__)) == 1
        assert len(_debug_get_cache_entry_list(_tail_chunk_stats.__code__)) == 2
    finally:
        torch._dynamo.reset()


def legacy_head(
    self: TappedTarget,
    final_ND: torch.Tensor,
    hidden_NKD: torch.Tensor,
    scale_NK: torch.Tensor | None,
) -> BatchOutput:
    """TappedTarget._head before head_stats.py, verbatim: the reference for the stored bits."""
    N, k, dev = final_ND.shape[0], self.topk, self.device
    argmax_N = torch.empty(N, dtype=torch.int32, device=dev)
    ids_Nk = torch.empty(N, k, dtype=torch.int32, device=dev)
    vals_Nk = torch.empty(N, k, dtype=torch.float32, device=dev)
    lse_N = torch.empty(N, dtype=torch.float32, device=dev)
    logits_NV = None
    if self.full_logits:
        logits_NV = torch.empty(N, self.head.out_features, dtype=torch.bfloat16, device=dev)
    for lo in range(0, N, self.head_chunk):
        hi = min(lo + self.head_chunk, N)
        raw_CV = self.head(final_ND[lo:hi])
        argmax_N[lo:hi] = raw_CV.argmax(-1).to(dev)
        vals, ids = raw_CV.topk(k, dim=-1)
        vals_Nk[lo:hi], ids_Nk[lo:hi] = vals.to(dev, torch.float32), ids.to(dev, torch.int32)
        lse_N[lo:hi] = torch.logsumexp(raw_CV.float(), dim=-1).to(dev)
        if logits_NV is not None:
            logits_NV[lo:hi] = raw_CV.to(dev, torch.bfloat16)
    return BatchOutput(hidden_NKD, scale_NK, argmax_N, ids_Nk, vals_Nk, lse_N, logits_NV)


@pytest.mark.slow
def test_tapped_target_compiled_head(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verifier.compile_head: unset, off for a CPU target; true runs the compiled graphs in
    TappedTarget and stores what the replaced code stored (log-sum-exp to fp32 rounding)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.bfloat16).eval()
    assert TappedTarget(model, [0], K, 50, False, "bfloat16").compile_head is False
    target = TappedTarget(model, [0], K, 50, True, "bfloat16", compile_head=True)
    ids_BT = torch.randint(0, model.config.vocab_size, (2, 60), generator=torch.manual_seed(0))
    lengths = [60, 45]  # 105 tokens: chunks of 50, 50 and 5
    torch._dynamo.reset()
    try:
        got = target.forward(ids_BT, lengths)
    finally:
        torch._dynamo.reset()
    monkeypatch.setattr(TappedTarget, "_head", legacy_head)
    want = target.forward(ids_BT, lengths)
    for name in ("hidden_NKD", "argmax_N", "topk_ids_Nk", "topk_logits_Nk", "logits_NV"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.lse_N, want.lse_N, **LSE_TOL)


def store_arrays(store: Path) -> dict[str, np.ndarray]:
    out = {}
    for index in range(open_store(store, require_complete=True).num_shards):
        group = zarr.open_group(store / "shards" / f"shard-{index:06d}", mode="r")
        out.update({f"{index}/{name}": array[...] for name, array in group.arrays()})
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_extract_output_unchanged(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The tiny example extracted (chunks of 50 rows: batches end on short chunks, full logits
    stored too) is bit for bit what the replaced head code wrote."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(EXAMPLE_DATA.read_text().splitlines()[:12]) + "\n")

    def extract(out: Path) -> dict[str, np.ndarray]:
        overrides = [
            f"target.model={tiny_qwen3}",
            f"target.dtype={dtype}",
            f"data.path={data}",
            f"store.out={out}",
            "packing.seq_len=64",
            "store.sequences_per_shard=4",
            "run.batch_tokens=256",
            "run.progress=false",
            "verifier.head_chunk_tokens=50",
            "verifier.store_full_logits=true",
        ]
        run_extract(build_config(ExtractConfig, DEBUG, "extract", overrides))
        return store_arrays(out)

    new = extract(tmp_path / "new")
    monkeypatch.setattr(TappedTarget, "_head", legacy_head)
    old = extract(tmp_path / "old")
    assert new.keys() == old.keys() and any(k.endswith("/logsumexp") for k in new)
    for name in new:
        np.testing.assert_array_equal(new[name], old[name], err_msg=name)
