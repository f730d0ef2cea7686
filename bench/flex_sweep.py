"""What flex_attention's own knobs give on the anchor-block mask (issue 12): `bench_attention.py
--sweep` runs this.

Each variant is flex_attention compiled as its own region (``torch.compile(fullgraph=True,
dynamic=False)``, a guard that raises if the frame ever runs eagerly), like
`stage2_train.attention.block_attention`, under a different BlockMask tile size and/or
``kernel_options`` (the names torch 2.11 accepts: ``fwd_``/``bwd_`` prefixed BLOCK_M, BLOCK_N,
BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages; PRESCALE_QK,
ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS, WRITE_DQ, USE_TMA, BACKEND). The baseline is the
project's own region at 128x128 tiles (`project_region`), then anchor orderings under that same
compiled region (a new mask is new tensors: no recompile), then one compile per variant.

Inductor skips every backward config whose block sizes do not divide the BlockMask's tiles,
checking its built-in config *before* applying kernel_options (torch 2.11
``torch/_inductor/kernel/flex/flex_attention.py``): with a 64-row Q tile the H100/H200 default
(64, 128, 128, 64) leaves no config at all, which is why tiles other than 128 "failed to lower"
(notes/performance.md). A variant with ``bwd`` therefore replaces the config list with exactly
its own, and also writes it into kernel_options (so the compiled graph, and inductor's cache key,
carry it).

Every variant's output and input gradients are compared with an fp32 SDPA reference on the
same dense mask; ``valid`` is false when any error exceeds 3x the baseline's (or 1e-2). A
variant that fails (lowering error, OOM, out of shared memory, per-variant timeout) is recorded
and the sweep goes on; once ``budget_s`` is spent the remaining variants are recorded as skipped.

Legend: H query heads, G key/value heads, Q = A*B query tokens, KV = S + Q keys, E head dim.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from stage2_train.attention import block_attention
from stage2_train.masks import anchor_block_mask

# (BLOCK_M, BLOCK_N, num_stages, num_warps) and (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2,
# num_stages, num_warps); the backward kernel needs BLOCK_N1 % BLOCK_M1 == 0 and
# BLOCK_M2 % BLOCK_N2 == 0. torch 2.11's H100/H200 defaults at head dim 128, bf16:
# forward (128, 64, 3, 8), backward (64, 128, 128, 64, 3, 8).
FwdConfig = tuple[int, int, int, int]
BwdConfig = tuple[int, int, int, int, int, int]
COMBO = "combo"  # placeholder: the fastest valid tile/config variant plus every flag that won


@dataclass
class Variant:
    name: str
    idea: str
    tile: tuple[int, int] = (128, 128)  # BlockMask (Q rows, KV columns) per tile
    options: dict[str, Any] = field(default_factory=dict)
    fwd: FwdConfig | None = None
    bwd: BwdConfig | None = None
    mode: str | None = None  # torch.compile mode
    est_s: float = 15.0  # compile + measure (~10 s seen for the baseline), for the budget

    def kernel_options(self) -> dict[str, Any]:
        opts = dict(self.options)
        if self.fwd:
            keys = ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps")
            opts.update({f"fwd_{k}": v for k, v in zip(keys, self.fwd, strict=True)})
        if self.bwd:
            keys = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")
            opts.update({f"bwd_{k}": v for k, v in zip(keys, self.bwd, strict=True)})
        return opts


# Most promising first: the sweep stops at its budget. Shares of the seed shape's Q x KV grid
# that run (partial + full tiles, measured on the CPU with create_block_mask): 128x128 14.9%,
# 64x128 12.7%, 64x64 11.4%, 32x128 11.3%, 16x128 10.7%; mask density 8.3%.
VARIANTS = [
    Variant(
        "q64_kv64",
        "BlockMask at 64x64 tiles: 11.4% of the grid runs (vs 14.9%), partial tiles 4.9% (vs 10.2%)",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(64, 64, 64, 64, 3, 4),
    ),
    Variant(
        "q16_kv128",
        "Q tile = one anchor block (16 rows): each tile sees one interval + its own block",
        tile=(16, 128),
        fwd=(16, 64, 3, 4),
        bwd=(16, 128, 16, 16, 3, 4),
    ),
    Variant(
        "q64_kv128",
        "BlockMask at 64x128 tiles (12.7% of the grid runs)",
        tile=(64, 128),
        fwd=(64, 64, 3, 4),
        bwd=(64, 128, 64, 64, 3, 8),
    ),
    Variant(
        "prescale_qk",
        "PRESCALE_QK: scale q once, not every score tile",
        options={"PRESCALE_QK": True},
    ),
    Variant(
        "rows_safe",
        "ROWS_GUARANTEED_SAFE: every row sees its own block, so skip the empty-row guard",
        options={"ROWS_GUARANTEED_SAFE": True},
    ),
    Variant(
        "q32_kv128",
        "BlockMask at 32x128 tiles (11.3% of the grid runs)",
        tile=(32, 128),
        fwd=(32, 64, 3, 4),
        bwd=(32, 128, 32, 32, 3, 4),
    ),
    Variant("bwd_64x64", "backward kernel tiles 64/64/64/64, 4 warps", bwd=(64, 64, 64, 64, 3, 4)),
    Variant(COMBO, "fastest valid tile/config variant + every flag that beat the baseline"),
    Variant("default", "the sweep's own region without options (must match project_region)"),
    Variant("fwd_128x128", "forward kernel tiles 128x128, 2 stages, 8 warps", fwd=(128, 128, 2, 8)),
    Variant(
        "bwd_32x128", "backward kernel tiles 32/128/128/32, 4 warps", bwd=(32, 128, 128, 32, 3, 4)
    ),
    Variant(
        "write_dq_off", "WRITE_DQ=False: dQ written in the dK/dV loop", options={"WRITE_DQ": False}
    ),
    Variant("tma", "USE_TMA: Hopper's bulk tensor copies for K/V tiles", options={"USE_TMA": True}),
    Variant(
        "flash_backend",
        "BACKEND=FLASH (cute-dsl flash kernels; needs flash-attn's cute package)",
        options={"BACKEND": "FLASH"},
        est_s=10.0,
    ),
    Variant(
        "blocks_contiguous",
        "BLOCKS_ARE_CONTIGUOUS: wrong for this mask (own block is far from the context "
        "interval); expected invalid, a check of the checker",
        options={"BLOCKS_ARE_CONTIGUOUS": True},
    ),
    Variant(
        "q64_kv64_bwd32",
        "64x64 tiles with backward tiles 32/64/64/32",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(32, 64, 64, 32, 3, 4),
    ),
    Variant(
        "max_autotune",
        "torch.compile mode max-autotune-no-cudagraphs at 128x128 tiles",
        mode="max-autotune-no-cudagraphs",
        est_s=120.0,
    ),
]
FLAGS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "WRITE_DQ", "USE_TMA")


@dataclass
class Problem:
    """Inputs of one attention call: q [1,H,Q,E], k/v [1,G,KV,E] (leaves), grad [1,H,Q,E]."""

    q: Tensor
    k: Tensor
    v: Tensor
    grad: Tensor
    ctx_lo_A: Tensor
    ctx_hi_A: Tensor
    context_len: int
    block_size: int
    mask_mod: Callable


def _region(kernel_options: dict[str, Any] | None) -> Callable[..., Tensor]:
    def flex_region(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
        if not torch.compiler.is_compiling():  # constant-folded while Dynamo traces
            raise RuntimeError("flex_attention ran eagerly: the compiled region fell back")
        return flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options
        )

    return flex_region


@contextlib.contextmanager
def forced_bwd_config(config: BwdConfig | None) -> Iterator[None]:
    """Make inductor consider exactly `config` for flex's backward (see the module docstring)."""
    if config is None:
        yield
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.template_heuristics.triton import FlexBwDConfig

    original = InductorChoices.get_flex_attention_bwd_configs
    InductorChoices.get_flex_attention_bwd_configs = lambda self, *a, **k: [  # type: ignore[method-assign]
        FlexBwDConfig(*config)
    ]
    try:
        yield
    finally:
        InductorChoices.get_flex_attention_bwd_configs = original  # type: ignore[method-assign]


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """TimeoutError in the main thread after `seconds` (checked between Python bytecodes)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"variant exceeded {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _rel(x: Tensor, ref: Tensor) -> float:
    return float(f"{((x.float() - ref).norm() / ref.norm()).item():.3g}")


class Sweep:
    """Runs variants against the baseline; `emit` gets one dict per record."""

    def __init__(
        self,
        problem: Problem,
        timer: Callable[[Callable[[], Any]], float],
        emit: Callable[[dict], None],
        *,
        backward: bool,
        budget_s: float,
        variant_timeout_s: float,
    ) -> None:
        self.p, self.timer, self.emit = problem, timer, emit
        self.backward, self.budget_s, self.variant_timeout_s = backward, budget_s, variant_timeout_s
        self.cuda = problem.q.device.type == "cuda"
        self.started = time.perf_counter()
        self.masks: dict[tuple[int, int], BlockMask] = {}
        self.results: dict[str, dict] = {}
        self.baseline: dict | None = None
        self.baseline_out: Tensor | None = None  # project_region's output
        self.last_out: Tensor | None = None
        self.ref = self._reference()

    def _reference(self) -> dict[str, Tensor]:
        """fp32 SDPA on the dense mask: the output and, with backward, the input gradients."""
        p = self.p
        q_len, kv_len = p.q.size(2), p.k.size(2)
        q_idx = torch.arange(q_len, device=p.q.device)[:, None]
        kv_idx = torch.arange(kv_len, device=p.q.device)[None, :]
        dense = p.mask_mod(0, 0, q_idx, kv_idx)
        q, k, v = (t.detach().float().requires_grad_(self.backward) for t in (p.q, p.k, p.v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        ref = {"out": out.detach()}
        if self.backward:
            out.backward(p.grad.float())
            ref.update(dq=q.grad, dk=k.grad, dv=v.grad)
        return ref

    def block_mask(self, tile: tuple[int, int]) -> BlockMask:
        """128x128: the project's direct builder; other tiles: create_block_mask (eager)."""
        if tile not in self.masks:
            p = self.p
            if tile == (128, 128):
                mask = anchor_block_mask(p.ctx_lo_A, p.ctx_hi_A, p.context_len, p.block_size)
            else:
                q_len, kv_len = p.q.size(2), p.k.size(2)
                mask = create_block_mask(
                    p.mask_mod, 1, None, q_len, kv_len, device=p.q.device, BLOCK_SIZE=tile
                )
            self.masks[tile] = mask
        return self.masks[tile]

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def _measure(
        self,
        fn: Callable[..., Tensor],
        inputs: tuple[Tensor, Tensor, Tensor],
        mask: BlockMask,
        perm_A: Tensor | None = None,
    ) -> dict:
        """Compile (first call), check against the reference, time fwd (and fwd+bwd).

        With perm_A the inputs are in that block order: the output and gradients are put
        back in the reference's order before the check."""
        q, k, v = inputs
        grad = (
            self.p.grad if perm_A is None else _permute_rows(self.p.grad, perm_A, self.p.block_size)
        )
        record: dict[str, Any] = {}
        t0 = time.perf_counter()
        out = fn(q, k, v, mask)
        if self.backward:
            q.grad = k.grad = v.grad = None
            out.backward(grad)
        if self.cuda:
            torch.cuda.synchronize()
        record["compile_s"] = round(time.perf_counter() - t0, 1)
        got = {"out": out.detach()}
        if self.backward:
            got.update(dq=q.grad, dk=k.grad, dv=v.grad)
        for name, value in got.items():
            if perm_A is not None:
                value = self._unpermute(name, value, perm_A)
            record[f"rel_err_{name}"] = _rel(value, self.ref[name])
            if name == "out":
                self.last_out = value.float()
            if name == "out" and self.baseline_out is not None:  # max |diff| / max |baseline|
                diff = (self.last_out - self.baseline_out).abs().max()
                ratio = (diff / self.baseline_out.abs().max()).item()
                record["max_rel_err_vs_project"] = float(f"{ratio:.3g}")

        def fwd() -> Tensor:
            return fn(q, k, v, mask)

        def fwd_bwd() -> None:
            q.grad = k.grad = v.grad = None
            fn(q, k, v, mask).backward(grad)

        calls = [("fwd", fwd)] + ([("fwd_bwd", fwd_bwd)] if self.backward else [])
        for name, call in calls:
            if self.cuda:
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                call()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                record[f"{name}_peak_GB"] = round(peak / 1e9, 3)
            record[f"{name}_ms"] = round(self.timer(call), 4)
        return record

    def _unpermute(self, name: str, value: Tensor, perm_A: Tensor) -> Tensor:
        S, B, inverse_A = self.p.context_len, self.p.block_size, torch.argsort(perm_A)
        if name in ("out", "dq"):
            return _permute_rows(value, inverse_A, B)
        return torch.cat([value[:, :, :S], _permute_rows(value[:, :, S:], inverse_A, B)], dim=2)

    def _judge(self, record: dict) -> None:
        """valid: every error within 3x the baseline's (or 1e-2); speedup vs the baseline."""
        keys = [k for k in record if k.startswith("rel_err_")]
        if self.baseline is None:
            record["valid"] = all(record[k] < 1e-2 for k in keys)
            return
        record["valid"] = all(record[k] <= max(3 * self.baseline.get(k, 0.0), 1e-2) for k in keys)
        key = "fwd_bwd_ms" if self.backward else "fwd_ms"
        if key in record and key in self.baseline:
            record["speedup_vs_project"] = round(self.baseline[key] / record[key], 3)

    def run_baseline(self) -> None:
        """The project's compiled region (block_attention) on the project's 128x128 BlockMask."""
        record: dict[str, Any] = {"what": "sweep_variant", "name": "project_region"}
        record["idea"] = "stage2_train.attention.block_attention, anchors sorted (the baseline)"
        record["tile"] = [128, 128]
        try:
            mask = self.block_mask((128, 128))
            record["sparsity_pct"] = round(mask.sparsity(), 1)
            record.update(self._measure(block_attention, (self.p.q, self.p.k, self.p.v), mask))
            record["status"] = "ok"
            self._judge(record)
            self.baseline, self.baseline_out = record, self.last_out
        except Exception as err:  # the variants still run, compared with the reference only
            record.update(status="error", error=_short(err))
        self.results["project_region"] = record
        self.emit(record)

    def run_orderings(self, seed: int = 0) -> None:
        """Other anchor orders in the same compiled region: rows (and the block K/V slots)
        permuted, the output permuted back before the check."""
        p = self.p
        num_blocks, B = p.ctx_lo_A.numel(), p.block_size
        lengths_A = (p.ctx_hi_A - p.ctx_lo_A).long()
        orders = {
            "order_random": torch.randperm(
                num_blocks, generator=torch.Generator().manual_seed(seed)
            ).to(p.q.device),
            "order_by_length": torch.argsort(lengths_A, stable=True),
        }
        ideas = {
            "order_random": "anchors in random order (tiles mix far-apart intervals): a control",
            "order_by_length": "anchors sorted by visible-context length (balanced tiles, "
            "wider interval unions)",
        }
        for name, perm_A in orders.items():
            record: dict[str, Any] = {"what": "sweep_variant", "name": name, "idea": ideas[name]}
            record["tile"] = [128, 128]
            try:
                q, k, v = _permute_blocks(p, perm_A)
                mask = anchor_block_mask(p.ctx_lo_A[perm_A], p.ctx_hi_A[perm_A], p.context_len, B)
                record["sparsity_pct"] = round(mask.sparsity(), 1)
                record.update(self._measure(block_attention, (q, k, v), mask, perm_A))
                record["status"] = "ok"
                self._judge(record)
            except Exception as err:  # record, keep sweeping
                record.update(status="error", error=_short(err))
            self.results[name] = record
            self.emit(record)

    def _combo(self) -> Variant | None:
        """The fastest valid tile/config variant with every boolean flag that beat the baseline."""
        key = "fwd_bwd_ms" if self.backward else "fwd_ms"
        base = self.baseline[key] if self.baseline and key in self.baseline else None
        done = {n: r for n, r in self.results.items() if r.get("valid") and key in r}
        configs = [
            v
            for v in VARIANTS
            if v.name in done and not v.options and (v.fwd or v.bwd or v.tile != (128, 128))
        ]
        best = min(configs, key=lambda v: done[v.name][key], default=None)
        flags: dict[str, Any] = {}
        for v in VARIANTS:
            won = v.name in done and base and done[v.name][key] < 0.98 * base
            if won and v.options and set(v.options) <= set(FLAGS):
                flags.update(v.options)
        if not flags or (best is None and len(flags) < 2):
            return None
        start = best or Variant("x", "")
        return Variant(
            COMBO,
            f"{best.name if best else '128x128 defaults'} + {sorted(flags)}",
            tile=start.tile,
            options=flags,
            fwd=start.fwd,
            bwd=start.bwd,
        )

    def run_variant(self, variant: Variant) -> None:
        record: dict[str, Any] = {
            "what": "sweep_variant",
            "name": variant.name,
            "idea": variant.idea,
        }
        if variant.name == COMBO:
            combo = self._combo()
            if combo is None:
                record.update(status="skipped", reason="no flag beat the baseline")
                self.emit(record)
                return
            variant = combo
            record["idea"] = combo.idea
        opts = variant.kernel_options()
        record.update(tile=list(variant.tile), kernel_options=opts, mode=variant.mode)
        if self.elapsed() + variant.est_s > self.budget_s:
            record.update(status="skipped", reason=f"budget {self.budget_s:.0f} s")
            self.emit(record)
            return
        torch._dynamo.reset()  # a fresh cache: each variant compiles its own graph
        try:
            with (
                forced_bwd_config(variant.bwd if self.backward else None),
                time_limit(self.variant_timeout_s),
            ):
                mask = self.block_mask(variant.tile)
                record["sparsity_pct"] = round(mask.sparsity(), 1)
                region = torch.compile(
                    _region(opts or None), dynamic=False, fullgraph=True, mode=variant.mode
                )
                record.update(self._measure(region, (self.p.q, self.p.k, self.p.v), mask))
            record["status"] = "ok"
            self._judge(record)
        except Exception as err:  # lowering errors, OOM, timeouts: record, keep sweeping
            record.update(status="error", error=_short(err))
            if self.cuda:
                torch.cuda.empty_cache()
        self.results[variant.name] = record
        self.emit(record)

    def summary(self) -> dict:
        key = "fwd_bwd_ms" if self.backward else "fwd_ms"
        ok = {n: r for n, r in self.results.items() if r.get("valid") and key in r}
        best = min(ok, key=lambda n: ok[n][key], default=None)
        return {
            "what": "sweep_summary",
            "metric": key,
            "baseline_ms": self.baseline.get(key) if self.baseline else None,
            "best": best,
            "best_ms": ok[best][key] if best else None,
            "goal_ms": 0.45 if self.backward else None,
            "invalid": sorted(n for n, r in self.results.items() if r.get("valid") is False),
            "failed": sorted(n for n, r in self.results.items() if r.get("status") == "error"),
            "elapsed_s": round(self.elapsed(), 1),
        }


def _permute_rows(x_1HQE: Tensor, perm_A: Tensor, block_size: int) -> Tensor:
    """Rows grouped in blocks of `block_size`, blocks taken in the order perm_A."""
    _, heads, q_len, dim = x_1HQE.shape
    blocks = x_1HQE.reshape(1, heads, q_len // block_size, block_size, dim)
    return blocks[:, :, perm_A].reshape(x_1HQE.shape)


def _permute_blocks(p: Problem, perm_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q rows and the block part of k/v in block order perm_A, as new leaves."""
    S, B, grads = p.context_len, p.block_size, p.q.requires_grad
    q = _permute_rows(p.q.detach(), perm_A, B).contiguous().requires_grad_(grads)
    kv = []
    for t in (p.k, p.v):
        t = t.detach()
        block_part = _permute_rows(t[:, :, S:], perm_A, B)
        kv.append(torch.cat([t[:, :, :S], block_part], dim=2).contiguous().requires_grad_(grads))
    return q, kv[0], kv[1]


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {(text[0] if text else '')[:300]}"
