"""Hidden states in 4 bits (e2m1 values under shared scales): the nvfp4 store's encoding
(`store.hidden_dtype=nvfp4`, FORMAT.md "Hidden states": `quantize_nvfp4`, `dequantize_nvfp4`)
and the rounding `data.hidden_as_fp4` measures from a finer store (issue 12: five tapped layers
under 12 KB a token at the Qwen3-8B width need features under ~0.6 bytes; fp8 takes 1).

Two layouts, each a shared scale per block of features along the hidden size:
- "mxfp4" (OCP microscaling): 32 features a block, a power-of-two scale (one byte, e8m0),
  2^(floor(log2 amax) - 2), so the block's largest value lands in e2m1's top binade [4, 8),
  clamped to 6. 0.53 bytes a feature.
- "nvfp4" (NVIDIA's layout): 16 features a block, an e4m3 scale under one fp32 scale per
  token and layer (amax / (6 * 448)). The block scale is the one of least squared error among
  amax / 6 (the largest value maps to 6), amax / 4 and their e4m3 neighbours: any e4m3 scale
  decodes alike, so the choice is the encoder's. 0.56 bytes.

Values are rounded to the nearest e2m1 value, ties to the even code (IEEE's rule, as the
hardware's casts do). mxfp4's results are exactly representable in bf16 (at most 2
significant bits times a power of two); nvfp4's, times an fp32 scale, round once more when
cast to bf16, as an fp8 store's decode to the model's dtype does (0.2% at most, against
fp4's ~10%). Only nvfp4 has a store format; mxfp4 is measurable through the loader alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Fp4Kind = Literal["mxfp4", "nvfp4"]
BLOCK = {"mxfp4": 32, "nvfp4": 16}
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# e2m1's magnitudes; code i (0-7) holds E2M1_VALUES[i], so an even code has an even mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (uint8: magnitude code 0-7, sign in bit 3) nearest each value of x (fp32,
    already scaled): ties to the even code, magnitudes above 6 clamped to 6 (the OCP spec's
    conversion with saturation); NaN gives code 0 (a NaN row shows in its scale)."""
    magnitude = torch.nan_to_num(x.float().abs(), nan=0.0).clamp(max=E2M1_MAX)
    # e2m1's step is 0.5 below 2, 1 in [2, 4) and 2 from 4: the magnitude in steps, rounded
    # half to even (exact: the steps are powers of two), is the nearest value, and its parity
    # is the code's, so a tie goes to the even code. Elementwise arithmetic, not a search,
    # so that a compiled encoder (compiled_quantize_nvfp4) fuses it with the rest
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    value = torch.round(magnitude / step) * step
    code = torch.where(value < 2, value * 2, torch.where(value < 4, value + 2, value / 2 + 4))
    return (code + 8 * x.signbit()).to(torch.uint8)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (E2M1_VALUES by magnitude code, negated from bit 3)."""
    # arithmetic, not a table look-up: a gather's int64 index would be twice the fp32 result's
    # bytes, over every feature of a training batch (the step decodes nvfp4 stores so)
    m = (code & 7).float()
    magnitude = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2, m * 2 - 8))
    return torch.where(code >= 8, -magnitude, magnitude)


@dataclass
class Fp4Features:
    """Features as a 4-bit store would hold them: codes [..., D // block, block], the scale each
    block decodes with (fp32, [..., D // block, 1]) and the scale arrays a store would keep
    (mxfp4: the exponents + 127 as uint8; nvfp4: the e4m3 block scales' bits and the fp32 scale
    per row)."""

    codes: torch.Tensor
    block_scale: torch.Tensor
    stored_scales: list[torch.Tensor]

    def decoded(self) -> torch.Tensor:
        values = e2m1_value(self.codes) * self.block_scale
        return values.reshape(*values.shape[:-2], -1)


def encode_fp4(
    hidden_ND: torch.Tensor, kind: Fp4Kind, kernels: Nvfp4Kernels | None = None
) -> Fp4Features:
    """[..., D] features -> `kind`'s blocks (module docstring). D must be a multiple of the
    block. `kernels`: nvfp4's elementwise parts (default: eager; the compiled encoder passes
    their compiled twins)."""
    if kind not in BLOCK:
        raise ValueError(f"unknown fp4 layout {kind!r}: one of {', '.join(BLOCK)}")
    block = BLOCK[kind]
    D = hidden_ND.shape[-1]
    if D % block:
        raise ValueError(
            f"{kind} rounds blocks of {block} features; this hidden size, {D}, is not a multiple"
        )
    x = hidden_ND.float()
    blocks = x.reshape(*x.shape[:-1], D // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    if kind == "mxfp4":
        # a zero block decodes to zeros whatever its scale; the clamp keeps log2 finite
        exponent = torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))) - 2
        scale = torch.exp2(exponent)
        stored = [(exponent.clamp(-127, 127) + 127).to(torch.uint8)]  # e8m0's range
    else:
        per_row = amax.amax(-2, keepdim=True) / (E2M1_MAX * E4M3_MAX)
        per_row = torch.where(per_row == 0, torch.ones_like(per_row), per_row)
        e4m3, scale, codes = _nvfp4_least_error_scales(
            blocks, amax, per_row, kernels or Nvfp4Kernels()
        )
        return Fp4Features(codes, scale, [e4m3.view(torch.uint8), per_row])
    return Fp4Features(_block_codes(blocks, scale), scale, stored)


def _block_codes(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes of `blocks` under their decode `scale`; a block whose scale is zero (an
    e4m3 scale that underflowed) holds zeros, as it decodes."""
    return e2m1_code(torch.where(scale == 0, 0.0, blocks / torch.where(scale == 0, 1.0, scale)))


# the block-scale candidates, as (the value the block's amax maps to, a step of the e4m3 bits):
# amax -> 6 (the layout's rule), one e4m3 step below and above it, then amax -> 4 and its two
# neighbours. 4 leaves e2m1's widest gap (4 to 6) unused at the top, which serves a block of
# one outlier and many mid-sized values; the neighbours trade the top value's error against
# the rest's. Picking the least squared error of the six took pystd-28m's features from 9.5%
# to 8.3% RMS error (a search of every e4m3 scale from amax / 6.5 to amax / 2.5: 8.3% too)
NVFP4_SCALE_CANDIDATES = ((6.0, 0), (6.0, -1), (6.0, 1), (4.0, 0), (4.0, -1), (4.0, 1))
E4M3_MAX_BITS = 0x7E  # 448; 0x7F is NaN


def nvfp4_candidate(
    blocks: torch.Tensor,
    amax: torch.Tensor,
    per_row: torch.Tensor,
    top: torch.Tensor,
    step: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block-scale candidate of [..., B, 16] `blocks`: the e4m3 scale mapping each block's
    amax to `top`, `step` e4m3 steps away (0-d tensors, so that one compiled graph serves all
    six), as (its bits [..., B, 1], the block's float64 squared error under it). The codes it
    would give are not kept: only the chosen candidate's are made (`_nvfp4_codes`), so six
    candidates cost six reads of the features and no copies of their codes."""
    e4m3 = (amax / top / per_row).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    bits = (e4m3.view(torch.uint8).int() + step).clamp(0, E4M3_MAX_BITS).to(torch.uint8)
    scale, codes = _nvfp4_codes(blocks, bits, per_row)
    error = ((e2m1_value(codes) * scale).double() - blocks.double()).square().sum(-1, True)
    return bits, error


def _nvfp4_codes(
    blocks: torch.Tensor, bits: torch.Tensor, per_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 decode scales, codes) of [..., B, 16] `blocks` under e4m3 block-scale `bits`."""
    scale = bits.view(torch.float8_e4m3fn).float() * per_row
    return scale, _block_codes(blocks, scale)


@dataclass(frozen=True)
class Nvfp4Kernels:
    """The nvfp4 encoder's elementwise parts over the features: a candidate's bits and error
    (`nvfp4_candidate`), and the chosen scale's codes (`_nvfp4_codes`). Eager by default;
    `compiled_quantize_nvfp4` passes each as one compiled region."""

    candidate: Callable[..., tuple[torch.Tensor, torch.Tensor]] = nvfp4_candidate
    codes: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _nvfp4_codes


def _nvfp4_least_error_bits(
    blocks: torch.Tensor, amax: torch.Tensor, per_row: torch.Tensor, candidate: Callable
) -> torch.Tensor:
    """The e4m3 block-scale bits [..., B, 1] of [..., B, 16] `blocks`: of
    NVFP4_SCALE_CANDIDATES, the first of least squared error (fp64) of the decoded block
    (FORMAT.md "Hidden states"). A NaN error never wins, and a block whose first candidate's
    error is NaN (a NaN feature) keeps that first candidate: a comparison in turn's rule."""
    bits, errors = [], []
    for top, step in NVFP4_SCALE_CANDIDATES:
        # on the features' device: a compiled graph then takes no host scalar among them
        top_t = torch.tensor(top, device=blocks.device)
        step_t = torch.tensor(step, dtype=torch.int32, device=blocks.device)
        found_bits, error = candidate(blocks, amax, per_row, top_t, step_t)
        # as compared in turn with `<`: a NaN first candidate is never beaten, a later NaN
        # never beats
        error = error.nan_to_num(nan=-math.inf if not errors else math.inf)
        bits.append(found_bits)
        errors.append(error)
    # argmin: the first of the least, as `<` in turn keeps the earlier of equals
    best = torch.stack(errors).argmin(0, keepdim=True)
    return torch.stack(bits).gather(0, best)[0]


def _nvfp4_least_error_scales(
    blocks: torch.Tensor, amax: torch.Tensor, per_row: torch.Tensor, kernels: Nvfp4Kernels
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 block scales, their fp32 decode scales, codes) of [..., B, 16] `blocks` under the
    least-error block scales (`_nvfp4_least_error_bits`). The parts see every block as a row
    of [M, 16] (per_row repeated for each of its blocks): compiled, one graph with one dynamic
    size, M, and the block's 16 static, whatever the features' leading shape (an extract
    batch's [N, D], a training batch's [T, K, D])."""
    blocks_M16 = blocks.reshape(-1, blocks.shape[-1])
    amax_M1 = amax.reshape(-1, 1)
    # contiguous: a single row's reshape stays a stride-0 view, which a compiled graph guards
    per_row_M1 = per_row.expand(amax.shape).reshape(-1, 1).contiguous()
    bits_M1 = _nvfp4_least_error_bits(blocks_M16, amax_M1, per_row_M1, kernels.candidate)
    scale_M1, codes_M16 = kernels.codes(blocks_M16, bits_M1, per_row_M1)
    return (
        bits_M1.view(torch.float8_e4m3fn).reshape(amax.shape),
        scale_M1.reshape(amax.shape),
        codes_M16.reshape(blocks.shape),
    )


def round_features_fp4(hidden_ND: torch.Tensor, kind: Fp4Kind) -> torch.Tensor:
    """[..., D] features -> the same shape in fp32, each block of the last dimension rounded as
    `kind` (module docstring) stores it and decoded. D must be a multiple of the block."""
    return encode_fp4(hidden_ND, kind).decoded()


def nvfp4_row_bytes(hidden_size: int) -> int:
    """Bytes of one stored nvfp4 row of `hidden_size` features (store.hidden_dtype=nvfp4): the
    codes two to a byte, then one e4m3 scale per block of 16."""
    return hidden_size // 2 + hidden_size // BLOCK["nvfp4"]


def nvfp4_codes_bytes(row_bytes: int) -> int:
    """Where the block scales of an nvfp4 row of `row_bytes` bytes begin (after D / 2 bytes of
    codes; D = row_bytes * 16 / 9)."""
    block = BLOCK["nvfp4"]
    hidden_size = row_bytes * block // (block // 2 + 1)
    if nvfp4_row_bytes(hidden_size) != row_bytes:
        raise ValueError(f"{row_bytes} bytes is not the width of an nvfp4 row of any hidden size")
    return hidden_size // 2


def quantize_nvfp4(
    hidden_ND: torch.Tensor, kernels: Nvfp4Kernels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (uint8 rows [..., nvfp4_row_bytes(D)], fp32 scale [...]): the FORMAT.md
    nvfp4 encoding of `hidden_dtype: "nvfp4"`. A row is D / 2 bytes of e2m1 codes, feature 2i
    in the low nibble of byte i and 2i + 1 in the high one, then D / 16 bytes holding the
    float8_e4m3fn bits of each block's scale; the fp32 scale is the row's (per token and
    layer). Decodes to exactly what `round_features_fp4(hidden, "nvfp4")` gives. D must be a
    multiple of 16."""
    encoded = encode_fp4(hidden_ND, "nvfp4", kernels)
    codes_ND = encoded.codes.flatten(-2)
    packed_ND = codes_ND[..., 0::2] | (codes_ND[..., 1::2] << 4)
    block_bits, row_scale = encoded.stored_scales
    row_bytes = torch.cat([packed_ND, block_bits.flatten(-2)], dim=-1)
    return row_bytes, row_scale.reshape(hidden_ND.shape[:-1])


@functools.cache
def compiled_quantize_nvfp4() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_nvfp4` with its elementwise parts compiled (extract's encoder where the head is
    compiled: a CUDA target's default): each block-scale candidate one region, its codes fused
    into its error and never written (one graph serves all six: their target and step are
    tensors), and the chosen scale's codes another; each serves every batch's token count
    (`_rows_dynamic`). Eager a candidate is ~30 elementwise passes over the features. The same
    bytes as eager on the CPU. The whole encoder as one region compiled 4x as long (57 s
    against 14 s on this project's CPU) for the six candidates unrolled. fullgraph: a graph
    break raises instead of running eager silently."""
    kernels = Nvfp4Kernels(
        candidate=_rows_dynamic(torch.compile(nvfp4_candidate, fullgraph=True)),
        codes=_rows_dynamic(torch.compile(_nvfp4_codes, fullgraph=True)),
    )
    return functools.partial(quantize_nvfp4, kernels=kernels)


def _rows_dynamic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` with its [M, ...] inputs' M marked dynamic before each call: one graph for
    every batch, the other sizes (a block's 16) static. dynamic=True made every size symbolic,
    the 16 of the per-block reduction included."""

    def call(*tensors: torch.Tensor) -> Any:
        for tensor in tensors:
            if tensor.dim() == 2:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return compiled(*tensors)

    return call


def dequantize_nvfp4(
    row_bytes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The FORMAT.md nvfp4 decode of rows [..., W] (W = nvfp4_row_bytes(D)) with their fp32
    scales [...]: e2m1(code) * float(e4m3 block scale) * scale, in fp32, then `dtype`."""
    half = nvfp4_codes_bytes(row_bytes.shape[-1])
    packed, block_bits = row_bytes[..., :half], row_bytes[..., half:]
    block, D = BLOCK["nvfp4"], 2 * half
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], D)
    block_scale = block_bits.view(torch.float8_e4m3fn).float() * scale[..., None].float()
    values = e2m1_value(codes.reshape(*codes.shape[:-1], D // block, block))
    return (values * block_scale[..., None]).flatten(-2).to(dtype)
