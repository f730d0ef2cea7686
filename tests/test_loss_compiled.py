"""loss.compile_chunks: the chunk math compiled by inductor (CPU here) equals the eager path, and
compiles once per chunk shape, never again across steps.

Tolerance: the two paths do the same fp32 arithmetic; inductor sums the vocabulary in another
order and uses its own vectorised exp, which moved the loss and the gradients by <= 2e-7 of
their scale on these inputs. 1e-5 leaves 50x room for other CPUs and reduction widths, while a
real slip (a lost weight, a wrong one-hot column, a missing KL term) moves them by > 1e-2. The
bf16 gradient is rounded to bf16 per logit: an fp32 difference at a rounding boundary flips one
element by a bf16 ulp (2^-8 relative), so bf16 gradients get one bf16 ulp of their scale.

Legend: A anchors, B slots, Q = A*B rows, D hidden, V vocabulary, k top-k.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, build_store
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from common.config import build_config
from stage2_train.anchors import slot_weights
from stage2_train.config import TrainConfig, with_compile_defaults
from stage2_train.loss import chunk_terms, chunked_block_loss
from stage2_train.resume import config_changes
from stage2_train.train import run_train

A, B, D, V, TOPK = 6, 8, 32, 1000, 5
CHUNK = 40  # 48 rows: a chunk of 40 (whole blocks, as D-PACE needs) and a ragged one of 8
DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (and its graphs don't count against the next's limit)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden_QD = torch.randn(A * B, D, generator=g).to(dtype)
    head_VD = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    labels_AB = torch.randint(0, V, (A, B), generator=g)
    hit_AB = torch.rand(A, B, generator=g) > 0.5  # labels = the argmax: accuracy is not all 0
    argmax_AB = (hidden_QD @ head_VD.T).float().argmax(-1).view(A, B)
    labels_AB = torch.where(hit_AB, argmax_AB, labels_AB)
    mask_AB = torch.rand(A, B, generator=g) > 0.3
    mask_AB[:, 0] = False
    weights_AB = slot_weights(B)[None, :] * mask_AB
    logits_QV = torch.randn(A * B, V, generator=g) * 3
    top = logits_QV.topk(TOPK, dim=-1)
    topk_lp = (top.values - logits_QV.logsumexp(-1, keepdim=True)).to(dtype)
    return hidden_QD, head_VD, labels_AB, weights_AB, top.indices, topk_lp


def loss_and_grads(compiled: bool, dtype: torch.dtype, lam: float, alpha: float, chunk: int):
    h, head, labels, weights, tid, tlp = inputs(dtype)
    h, head = h.requires_grad_(), head.requires_grad_()
    loss, stats = chunked_block_loss(
        h, head, labels, weights, chunk, tid, tlp, lam, 2.0, alpha, compiled=compiled
    )
    loss.backward()
    return loss, stats, h.grad, head.grad


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.float().abs().max().item()
    ulps = 2**-8 if expected.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=max(ulps, 1e-5), atol=ulps * scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lam,alpha", [(0.0, 0.0), (0.5, 0.0), (0.5, 0.5)], ids=["ce", "distill", "distill+dpace"]
)
def test_compiled_chunks_equal_eager(dtype: torch.dtype, lam: float, alpha: float) -> None:
    loss, stats, grad_h, grad_w = loss_and_grads(False, dtype, lam, alpha, CHUNK)
    loss_c, stats_c, grad_h_c, grad_w_c = loss_and_grads(True, dtype, lam, alpha, CHUNK)
    assert counters["stats"]["unique_graphs"] == 2  # the full chunk and the ragged tail
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    for key in ("ce_sum", "distill_sum"):
        torch.testing.assert_close(stats_c[key], stats[key], rtol=1e-5, atol=1e-6)
    for key in ("weight_sum", "correct_B", "total_B"):
        assert torch.equal(stats_c[key], stats[key]), key
    assert stats["correct_B"].sum() > 5
    assert grad_h_c.dtype == grad_h.dtype == dtype and grad_w_c.dtype == dtype
    assert_grad_close(grad_h_c, grad_h)
    assert_grad_close(grad_w_c, grad_w)


def test_no_recompile_across_steps_and_no_grad_path() -> None:
    """A frozen head, as in training: two graphs on the first step (the chunk of 20 rows and
    the tail of 8), then none, whatever the data; a forward without grad is one more graph."""
    for step in range(3):
        h, head, labels, weights, _, _ = inputs(torch.float32, seed=step)
        h.requires_grad_()
        loss, _ = chunked_block_loss(h, head, labels, weights, 20, compiled=True)
        loss.backward()
        assert len(_debug_get_cache_entry_list(chunk_terms.__code__)) == 2, step
    assert counters["stats"]["unique_graphs"] == 2
    h = h.detach()
    with torch.no_grad():
        eager, stats = chunked_block_loss(h, head, labels, weights, 20)
        compiled, stats_c = chunked_block_loss(h, head, labels, weights, 20, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    assert torch.equal(stats_c["correct_B"], stats["correct_B"])
    assert len(_debug_get_cache_entry_list(chunk_terms.__code__)) == 4


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_training_with_compiled_chunks_matches_eager(tmp_path: Path, dtype: str) -> None:
    """`dflash train` with loss.compile_chunks=true: the losses of eager (also under `mixed`'s
    bf16 autocast), two graphs for the whole run (128 query tokens per step in chunks of 48:
    48, 48 and a tail of 32)."""
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=7))

    def train(out: str, *sets: str) -> list[float]:
        base = [f"data.store={store}", f"run.out={tmp_path / out}", "run.progress=false"]
        base += ["optim.max_steps=4", "data.holdout_sequences=2", "loss.head_chunk_tokens=48"]
        base += [f"run.dtype={dtype}"]
        run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    eager = train("eager")
    compiled = train("compiled", "loss.compile_chunks=true")
    assert len(compiled) == 4
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert len(_debug_get_cache_entry_list(chunk_terms.__code__)) == 2


def test_switching_it_on_resume_is_free() -> None:
    """Another rounding of the same loss, like run.compile_layers: a resume may change it."""
    saved = dataclasses.asdict(TrainConfig())
    current = dataclasses.asdict(TrainConfig())
    current["loss"]["compile_chunks"] = True
    assert config_changes(saved, current) == ([], [])


def test_null_compiles_on_a_gpu_only() -> None:
    """run.compile_layers and loss.compile_chunks left null (the default): on for a GPU run,
    off on the CPU; a value the config sets is kept on either."""
    null = TrainConfig()
    assert (null.run.compile_layers, null.loss.compile_chunks) == (None, None)
    gpu = with_compile_defaults(null, on_gpu=True)
    cpu = with_compile_defaults(null, on_gpu=False)
    assert (gpu.run.compile_layers, gpu.loss.compile_chunks) == (True, True)
    assert (cpu.run.compile_layers, cpu.loss.compile_chunks) == (False, False)
    chosen = build_config(
        TrainConfig,
        DEBUG,
        "train",
        ["run.out=x", "data.store=s", "run.compile_layers=false", "loss.compile_chunks=true"],
    )
    for on_gpu in (True, False):
        kept = with_compile_defaults(chosen, on_gpu=on_gpu)
        assert (kept.run.compile_layers, kept.loss.compile_chunks) == (False, True)


def test_cuda_graphs_need_the_compiled_layers() -> None:
    """run.cuda_graphs with run.compile_layers=false is refused with the fix; null (on for
    GPUs) is accepted; switching it on resume is free (how kernels launch, not what they do)."""
    base = ["run.out=x", "data.store=s", "run.cuda_graphs=true"]
    with pytest.raises(ValueError, match="run.compile_layers=true"):
        build_config(TrainConfig, DEBUG, "train", [*base, "run.compile_layers=false"])
    assert build_config(TrainConfig, DEBUG, "train", base).run.cuda_graphs
    saved = dataclasses.asdict(TrainConfig())
    current = dataclasses.asdict(TrainConfig())
    current["run"]["cuda_graphs"] = True
    assert config_changes(saved, current) == ([], [])
