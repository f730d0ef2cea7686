"""The tile sizes of the drafter's flex_attention kernels (GPU), matched to 64-token mask tiles.

The anchor-block mask is sparse in a way that finer BlockMask tiles see: at 64x64 tokens 11.4%
of the Q x KV grid runs, against 14.9% at 128x128 (stage2_train/masks.py builds the tables at
``masks.TILE``). With Triton tiles to match (forward 64 x 64, 3 stages, 4 warps; backward
BLOCK_M1/N1/M2/N2 32/64/64/32, 3 stages, 4 warps) one layer's forward + backward at the seed
shape took 0.599 ms against 0.857 ms at 128x128 (1.43x; H200, torch 2.11, `bench/flex_sweep.py`,
BENCHMARKS.md). 64x64 tiles with inductor's default Triton tiles gained nothing (0.851 ms).

Inductor picks a flex kernel's Triton tiles from `InductorChoices`, and drops every candidate
whose tiles do not divide the BlockMask's before it reads ``kernel_options``: on an H100/H200
its only backward candidate (64, 128, 128, 64) does not divide 64, so 64-token mask tiles
"failed to lower" (notes/performance.md). `install` therefore makes InductorChoices offer
tiles that divide 64 (a class attribute: autograd compiles the backward lazily, on its own
thread, where a thread-local choices handler would not reach). bf16/fp16 with head dim <= 128
get the measured tiles; other dtypes and head dims keep inductor's own, capped at 64 tokens
(the fp32 evaluations' forward: 128 x 32 at head dim 64 becomes 64 x 32). Tiles of 64 divide
any mask tile of 64 or more, so other flex users in the process still lower. CPU and ROCm
kernels keep inductor's choices.

``DFLASH_FLEX_TILE=128`` (read by masks.py; loader workers inherit it) restores 128-token
mask tiles and inductor's own kernel tiles, for a torch whose InductorChoices lacks these
hooks (`install` names it in its error).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

FWD_TILES = (64, 64, 3, 4)  # BLOCK_M, BLOCK_N, num_stages, num_warps
BWD_TILES = (32, 64, 64, 32, 3, 4)  # BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, stages, warps
MAX_TILE = 64  # every Triton tile divides a 64-token mask tile
_HALF = (torch.bfloat16, torch.float16)
_METHODS = ("get_flex_attention_fwd_configs", "get_flex_attention_bwd_configs")
_originals: dict[str, Callable[..., list[Any]]] = {}


def _capped(config: Any) -> Any:
    """`config` (a FlexConfig or FlexBwDConfig dataclass) with its tiles capped at MAX_TILE."""
    tiles = {
        f.name: min(getattr(config, f.name), MAX_TILE)
        for f in dataclasses.fields(config)
        if f.name.startswith("block_")
    }
    return dataclasses.replace(config, **tiles)


def _nvidia(device_type: str | None) -> bool:
    """A CUDA kernel on NVIDIA (inductor's choices default device_type None to CUDA)."""
    return device_type in (None, "cuda") and not torch.version.hip


def _measured_applies(device_type: str | None, dtype: torch.dtype, head_dim: int) -> bool:
    """Where the measured tiles were measured: NVIDIA CUDA, bf16/fp16, head dim <= 128."""
    return _nvidia(device_type) and dtype in _HALF and head_dim <= 128


def fitted_configs(
    configs: list[Any], measured: Any, head_dim: int, dtype: torch.dtype, device_type: str | None
) -> list[Any]:
    """The candidates to offer inductor for one flex kernel: `measured` alone where it was
    measured (CUDA, bf16/fp16, head dim <= 128), else `configs` capped at MAX_TILE (deduplicated,
    order kept); CPU and ROCm keep `configs`."""
    if not _nvidia(device_type):
        return configs
    if _measured_applies(device_type, dtype, head_dim):
        return [measured]
    fitted: list[Any] = []
    for config in map(_capped, configs):
        if config not in fitted:
            fitted.append(config)
    return fitted


def forward_options(q: torch.Tensor, mask_tile: tuple[int, int]) -> dict[str, Any] | None:
    """The measured forward and backward tiles as flex kernel_options for query `q` under a
    BlockMask of `mask_tile` tokens, where they apply (`options_for`), else None. `install`
    offers the same tiles; passing them also puts them in the compiled graph (and inductor's
    cache key), as the sweep that measured them did, and set the backward's tiles on the
    candidate that autograd's lazy compile of it keeps (inductor drops candidates whose own
    tiles do not divide the mask's before it reads these, so `install` is still needed)."""
    return options_for(q.device.type, q.dtype, q.size(-1), tuple(mask_tile))


def options_for(
    device_type: str, dtype: torch.dtype, head_dim: int, mask_tile: tuple[int, ...]
) -> dict[str, Any] | None:
    """kernel_options of the measured tiles (fwd_* and bwd_*): CUDA, bf16/fp16, head dim <= 128,
    64-token mask tiles; None elsewhere (inductor's own choices, capped by `install` on CUDA)."""
    if not _measured_applies(device_type, dtype, head_dim) or mask_tile != (64, 64):
        return None
    fwd_keys = ("BLOCK_M", "BLOCK_N", "num_stages", "num_warps")
    bwd_keys = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps")
    return {f"fwd_{key}": value for key, value in zip(fwd_keys, FWD_TILES, strict=True)} | {
        f"bwd_{key}": value for key, value in zip(bwd_keys, BWD_TILES, strict=True)
    }


def install() -> None:
    """Make inductor offer flex kernels tiles that fit 64-token mask tiles (idempotent)."""
    if _originals:
        return
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.template_heuristics.triton import FlexBwDConfig, FlexConfig
    except ImportError as err:
        raise RuntimeError(_NO_HOOKS.format(err)) from err
    missing = [name for name in _METHODS if not hasattr(InductorChoices, name)]
    if missing:
        raise RuntimeError(_NO_HOOKS.format(f"InductorChoices has no {', '.join(missing)}"))
    measured = {_METHODS[0]: FlexConfig(*FWD_TILES), _METHODS[1]: FlexBwDConfig(*BWD_TILES)}
    for name in _METHODS:
        original = getattr(InductorChoices, name)

        def offered(
            self: Any,
            head_dim: int,
            dtype: torch.dtype,
            device_type: str | None = "cuda",
            _original: Callable[..., list[Any]] = original,
            _measured: Any = measured[name],
        ) -> list[Any]:
            configs = _original(self, head_dim, dtype, device_type)
            return fitted_configs(configs, _measured, head_dim, dtype, device_type)

        _originals[name] = original
        setattr(InductorChoices, name, offered)


@contextlib.contextmanager
def inductor_defaults() -> Iterator[None]:
    """Inductor's own flex tiles inside the block (benchmarks comparing other tilings)."""
    if not _originals:
        yield
        return
    from torch._inductor.choices import InductorChoices

    patched = {name: getattr(InductorChoices, name) for name in _originals}
    for name, original in _originals.items():
        setattr(InductorChoices, name, original)
    try:
        yield
    finally:
        for name, offered in patched.items():
            setattr(InductorChoices, name, offered)


_NO_HOOKS = (
    "this torch cannot be told which flex_attention tiles to use ({}): 64-token mask tiles "
    "would fail to lower. Set DFLASH_FLEX_TILE=128 in the environment (128-token tiles and "
    "inductor's own kernel tiles, ~1.4x slower attention), or use torch 2.11-2.13."
)
