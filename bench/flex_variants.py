"""The variants `bench/flex_sweep.py` times (issue 12), and how each one is compiled.

A variant is flex_attention compiled as its own region (``torch.compile(fullgraph=True,
dynamic=False)``, a guard that raises if the frame ever runs eagerly), like
`stage2_train.attention.block_attention`, under a different BlockMask tile size and/or
``kernel_options`` (the names torch 2.11 accepts: ``fwd_``/``bwd_`` prefixed BLOCK_M, BLOCK_N,
BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages; PRESCALE_QK,
ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS, WRITE_DQ, USE_TMA, BACKEND). ``combo`` is composed
once the others are measured: the fastest valid tile/config variant plus every flag that won.

Inductor skips every backward config whose block sizes do not divide the BlockMask's tiles,
checking its built-in config *before* applying kernel_options (torch 2.11
``torch/_inductor/kernel/flex/flex_attention.py``): with a 64-row Q tile the H100/H200 default
(64, 128, 128, 64) leaves no config at all, which is why tiles other than 128 "failed to lower"
(notes/performance.md). A variant with ``bwd`` therefore replaces the config list with exactly
its own (`forced_bwd_config`), and also writes it into kernel_options (so the compiled graph,
and inductor's cache key, carry it).

Imported by bench/flex_sweep.py and bench/bench_attention.py (bench/ is on sys.path); run the
sweep with `python bench/bench_attention.py --sweep` (see there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

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
    # around the fourteenth session's winner (64x64 tiles, bwd 32/64/64/32, 0.599 ms; now the
    # project's region): its neighbours first, since the sweep stops at its budget
    Variant(
        "bwd32_8warps",
        "64x64 tiles, bwd 32/64/64/32 with 8 warps",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(32, 64, 64, 32, 3, 8),
    ),
    Variant(
        "bwd32_2stages",
        "64x64 tiles, bwd 32/64/64/32 with 2 stages",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(32, 64, 64, 32, 2, 4),
    ),
    Variant(
        "bwd16",
        "64x64 tiles, bwd 16/64/64/16: the dK/dV loop over 16 query rows at a time",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(16, 64, 64, 16, 3, 4),
    ),
    # the H100's winner in the forty-third session (bwd16 0.670 vs the region's 1.005 ms): which
    # half of it wins (M1, the dK/dV loop's query rows; N2, the dQ loop's KV columns), and its
    # stage and warp neighbours
    Variant(
        "bwd16_m1",
        "64x64 tiles, bwd 16/64/64/32: only the dK/dV loop at 16 query rows",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(16, 64, 64, 32, 3, 4),
    ),
    Variant(
        "bwd16_n2",
        "64x64 tiles, bwd 32/64/64/16: only the dQ loop at 16 KV columns",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(32, 64, 64, 16, 3, 4),
    ),
    Variant(
        "bwd16_8warps",
        "64x64 tiles, bwd 16/64/64/16 with 8 warps",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(16, 64, 64, 16, 3, 8),
    ),
    Variant(
        "bwd16_2stages",
        "64x64 tiles, bwd 16/64/64/16 with 2 stages",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(16, 64, 64, 16, 2, 4),
    ),
    Variant(
        "bwd32_square",
        "64x64 tiles, bwd 32/32/32/32",
        tile=(64, 64),
        fwd=(64, 64, 3, 4),
        bwd=(32, 32, 32, 32, 3, 4),
    ),
    Variant(
        "fwd64x32",
        "64x64 tiles, fwd 64x32 (bwd 32/64/64/32)",
        tile=(64, 64),
        fwd=(64, 32, 3, 4),
        bwd=(32, 64, 64, 32, 3, 4),
    ),
    Variant(
        "q32_kv32",
        "32x32 tiles (finer sparsity than 64), fwd 32x32, bwd 32/32/32/32",
        tile=(32, 32),
        fwd=(32, 32, 3, 4),
        bwd=(32, 32, 32, 32, 3, 4),
    ),
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
    Variant(
        "default",
        "128x128 tiles, inductor's own kernel tiles: the project's region until the fourteenth "
        "session (project_region before)",
    ),
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
    # the region's own 64x64 tiles with inductor's autotuned kernel tiles instead of the fixed
    # 32/64/64/32: of the 28 backward candidates (torch 2.13's list; 2.11's may differ) the 12
    # dividing 64 remain (32 or 64 rows and columns at 1, 3, 4 or 5 stages) with the 16-token
    # default, so it asks whether the stages or the card pick better than the hand-chosen pair
    # (never run before the forty-fourth session)
    Variant(
        "max_autotune_64",
        "64x64 tiles, torch.compile mode max-autotune-no-cudagraphs picks the kernel tiles",
        tile=(64, 64),
        mode="max-autotune-no-cudagraphs",
        est_s=180.0,
    ),
]
FLAGS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "WRITE_DQ", "USE_TMA")


def combo_variant(results: dict[str, dict], baseline: dict | None, key: str) -> Variant | None:
    """The fastest valid tile/config variant with every boolean flag that beat the baseline."""
    base = baseline[key] if baseline and key in baseline else None
    done = {n: r for n, r in results.items() if r.get("valid") and key in r}
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


def region_for(kernel_options: dict[str, Any] | None) -> Callable[..., Tensor]:
    """What a variant compiles: flex_attention with its kernel_options, never run eagerly."""

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
