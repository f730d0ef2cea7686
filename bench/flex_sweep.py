"""What flex_attention's own knobs give on the anchor-block mask (issue 12): `bench_attention.py
--sweep` runs this.

Each variant (bench/flex_variants.py: BlockMask tile sizes, ``kernel_options``, compile mode)
is flex_attention compiled as its own region, like `stage2_train.attention.block_attention`.
The baseline is the project's own region on the project's tiles (`project_region`:
masks.TILE, 64x64 with stage2_train/flex_tiles.py's kernel tiles, since the fourteenth session;
`default` is the 128x128 region it replaced), then anchor orderings under that same compiled
region (a new mask is new tensors: no recompile), then one
compile per variant.

Every variant's output and input gradients are compared with an fp32 SDPA reference on the
same dense mask (bench/flex_check.py); ``valid`` is false when any error exceeds 3x the
baseline's (or 1e-2). A variant that fails (lowering error, OOM, out of shared memory,
per-variant timeout) is recorded and the sweep goes on; once ``budget_s`` is spent the
remaining variants are recorded as skipped.

With ``--rounds N`` the baseline and the chosen variants run N times in one process, the
variants' order rotated each round and every record carrying its ``round``; the summary ranks
by each one's median over the rounds and gives its range. One process's single figure was not
enough to rank backward tiles on H100s (forty-third session: the region 0.61-0.83 ms over six
processes, the same forward kernel 0.145-0.300 ms within one), so a ranking should come from
rounds in several processes.

    python bench/bench_attention.py --sweep --budget-s 240 # needs a CUDA GPU
    python bench/bench_attention.py --sweep --device cpu --tiny --only prescale_qk

Legend: H query heads, G key/value heads, Q = A*B query tokens, KV = S + Q keys, E head dim.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from flex_check import Problem, judge, permute_blocks, permute_rows, reference, rel_err, unpermute
from flex_variants import COMBO, Variant, combo_variant, forced_bwd_config, region_for
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from stage2_train import flex_tiles
from stage2_train.attention import block_attention, flex_layout, pack_heads, unpack_heads
from stage2_train.masks import TILE, anchor_block_mask


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
        self.round = 0  # the round running now (--rounds)
        self.by_round: dict[str, list[dict]] = {}  # each name's records, one a round
        self.baseline: dict | None = None
        self.baseline_out: Tensor | None = None  # project_region's output
        self.last_out: Tensor | None = None
        self.ref = reference(problem, backward)

    def block_mask(self, tile: tuple[int, int]) -> BlockMask:
        """Square tiles: the project's direct builder; others: create_block_mask (eager)."""
        if tile not in self.masks:
            p = self.p
            if tile[0] == tile[1]:
                mask = anchor_block_mask(
                    p.ctx_lo_A, p.ctx_hi_A, p.context_len, p.block_size, tile=tile[0]
                )
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
            self.p.grad if perm_A is None else permute_rows(self.p.grad, perm_A, self.p.block_size)
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
                value = unpermute(self.p, name, value, perm_A)
            record[f"rel_err_{name}"] = rel_err(value, self.ref[name])
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

    def run_baseline(self) -> None:
        """The project's compiled region (block_attention) on the project's BlockMask."""
        record: dict[str, Any] = {"what": "sweep_variant", "name": "project_region"}
        record["round"] = self.round
        record["idea"] = "stage2_train.attention.block_attention, anchors sorted (the baseline)"
        record["tile"] = [TILE, TILE]
        try:
            mask = self.block_mask((TILE, TILE))
            record["sparsity_pct"] = round(mask.sparsity(), 1)
            record.update(self._measure(block_attention, (self.p.q, self.p.k, self.p.v), mask))
            record["status"] = "ok"
            judge(record, self.baseline, self.backward)
            self.baseline, self.baseline_out = record, self.last_out
        except Exception as err:  # the variants still run, compared with the reference only
            record.update(status="error", error=_short(err))
        self._keep("project_region", record)

    @property
    def results(self) -> dict[str, dict]:
        """Each name's latest record."""
        return {name: records[-1] for name, records in self.by_round.items()}

    def _keep(self, name: str, record: dict) -> None:
        """Record `name`'s measurement of this round and emit it."""
        self.by_round.setdefault(name, []).append(record)
        self.emit(record)

    @contextlib.contextmanager
    def _judged(self, name: str, record: dict) -> Iterator[None]:
        """Around one variant's measurement: status ok and judged against the baseline, or
        the error recorded (the sweep goes on); the record is kept and emitted either way."""
        try:
            yield
            record["status"] = "ok"
            judge(record, self.baseline, self.backward)
        except Exception as err:  # record, keep sweeping
            record.update(status="error", error=_short(err))
        self._keep(name, record)

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
            record["round"] = self.round
            record["tile"] = [TILE, TILE]
            with self._judged(name, record):
                q, k, v = permute_blocks(p, perm_A)
                mask = anchor_block_mask(p.ctx_lo_A[perm_A], p.ctx_hi_A[perm_A], p.context_len, B)
                record["sparsity_pct"] = round(mask.sparsity(), 1)
                record.update(self._measure(block_attention, (q, k, v), mask, perm_A))

    def run_gqa_packed(self) -> None:
        """The query heads that share a key/value head folded into the rows
        (`stage2_train.attention.pack_heads`, `run.pack_heads`), in the project's compiled
        region on the project's tables (`rows_per_block`): at Qwen3-8B's 32/8 heads one 64-row
        tile is one anchor block (16 queries x 4 heads), so a tile's context is one anchor's
        interval instead of the union of four anchors' (as many programs as before, each
        visiting fewer key/value tiles). The timed call includes the pack and unpack copies;
        ``region_fwd_bwd_ms`` times the region alone on packed leaves."""
        p = self.p
        heads, groups = p.q.size(1), p.k.size(1)
        per_group = heads // groups
        rows = p.block_size * per_group

        def packed(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask) -> Tensor:
            return unpack_heads(block_attention(pack_heads(q, groups), k, v, mask), heads)

        for tile in (TILE, 128):
            name = f"gqa_packed_{tile}"
            record: dict[str, Any] = {"what": "sweep_variant", "name": name, "tile": [tile, tile]}
            record["round"] = self.round
            record["idea"] = (
                f"query heads folded into rows ({per_group} per key/value head): "
                f"{rows} rows an anchor block, {tile}-row tiles"
            )
            with self._judged(name, record):
                mask = anchor_block_mask(
                    p.ctx_lo_A, p.ctx_hi_A, p.context_len, p.block_size, tile, rows_per_block=rows
                )
                record["sparsity_pct"] = round(mask.sparsity(), 1)
                record.update(self._measure(packed, (p.q, p.k, p.v), mask))
                if self.backward:
                    record["region_fwd_bwd_ms"] = self._time_packed_region(mask, groups)

    def _time_packed_region(self, mask: BlockMask, groups: int) -> float:
        """fwd+bwd ms of the compiled region alone on packed leaves (no pack/unpack copies:
        the leaves already in the layout block_attention hands flex)."""
        p = self.p
        q = flex_layout(pack_heads(p.q.detach(), groups)).requires_grad_(True)
        grad = flex_layout(pack_heads(p.grad, groups))

        def fwd_bwd() -> None:
            q.grad = p.k.grad = p.v.grad = None
            block_attention(q, p.k, p.v, mask).backward(grad)

        return round(self.timer(fwd_bwd), 4)

    def run_variant(self, variant: Variant) -> None:
        record: dict[str, Any] = {
            "what": "sweep_variant",
            "name": variant.name,
            "round": self.round,
            "idea": variant.idea,
        }
        if variant.name == COMBO:
            key = "fwd_bwd_ms" if self.backward else "fwd_ms"
            combo = combo_variant(self.results, self.baseline, key)
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
                flex_tiles.inductor_defaults(),  # each variant its own tiles, not the project's
                forced_bwd_config(variant.bwd if self.backward else None),
                time_limit(self.variant_timeout_s),
            ):
                mask = self.block_mask(variant.tile)
                record["sparsity_pct"] = round(mask.sparsity(), 1)
                region = torch.compile(
                    region_for(opts or None), dynamic=False, fullgraph=True, mode=variant.mode
                )
                record.update(self._measure(region, (self.p.q, self.p.k, self.p.v), mask))
            record["status"] = "ok"
            judge(record, self.baseline, self.backward)
        except Exception as err:  # lowering errors, OOM, timeouts: record, keep sweeping
            record.update(status="error", error=_short(err))
            if self.cuda:
                torch.cuda.empty_cache()
        self._keep(variant.name, record)

    def spread(self, key: str) -> dict[str, dict[str, float]]:
        """Each name's `key` over its valid rounds: median, min, max and their count."""
        spreads = {}
        for name, records in self.by_round.items():
            values = [r[key] for r in records if r.get("valid") and key in r]
            if values:
                spreads[name] = {
                    "median": round(statistics.median(values), 4),
                    "min": min(values),
                    "max": max(values),
                    "rounds": len(values),
                }
        return spreads

    def summary(self) -> dict:
        """The best variant by its median over the rounds (one round: its one figure)."""
        key = "fwd_bwd_ms" if self.backward else "fwd_ms"
        spreads = self.spread(key)
        best = min(spreads, key=lambda n: spreads[n]["median"], default=None)
        baseline = spreads.get("project_region")
        return {
            "what": "sweep_summary",
            "metric": key,
            "baseline_ms": baseline["median"] if baseline else None,
            "best": best,
            "best_ms": spreads[best]["median"] if best else None,
            "spread": spreads,
            "goal_ms": 0.45 if self.backward else None,
            "invalid": sorted(n for n, r in self.results.items() if r.get("valid") is False),
            "failed": sorted(n for n, r in self.results.items() if r.get("status") == "error"),
            "elapsed_s": round(self.elapsed(), 1),
        }


def _short(err: BaseException) -> str:
    """The error's type and its text's lines joined, banner lines (==== ...) left out, up to
    4,000 characters: a lowering error's first line is often a banner alone, the cause below it
    (the flash backend's "CuteDSL template failed", forty-first session)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip(" =-")]
    return f"{type(err).__name__}: {' | '.join(lines)[:4000]}"
