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


def encode_fp4(hidden_ND: torch.Tensor, kind: Fp4Kind) -> Fp4Features:
    """[..., D] features -> `kind`'s blocks (module docstring). D must be a multiple of the
    block."""
    if kind not in BLOCK:
        raise ValueError(f"unknown fp4 layout {kind!r}: one of {', '.join(BLOCK)}")
    block = _check_hidden_size(hidden_ND, kind)
    D = hidden_ND.shape[-1]
    blocks = hidden_ND.float().reshape(*hidden_ND.shape[:-1], D // block, block)
    if kind == "nvfp4":
        blocks_M16 = blocks.reshape(-1, block)
        amax_M1, per_row_M1, per_row_N1 = nvfp4_block_amax(blocks_M16, D // block)
        bits_M1 = _nvfp4_least_error_bits(blocks_M16, amax_M1, per_row_M1, nvfp4_candidate)
        scale_M1, codes_M16 = _nvfp4_codes(blocks_M16, bits_M1, per_row_M1)
        scale_shape = (*blocks.shape[:-1], 1)
        return Fp4Features(
            codes_M16.reshape(blocks.shape),
            scale_M1.reshape(scale_shape),
            [bits_M1.reshape(scale_shape), per_row_N1.reshape(*blocks.shape[:-2], 1, 1)],
        )
    amax = blocks.abs().amax(-1, keepdim=True)
    # a zero block decodes to zeros whatever its scale; the clamp keeps log2 finite
    exponent = torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))) - 2
    scale = torch.exp2(exponent)
    stored = [(exponent.clamp(-127, 127) + 127).to(torch.uint8)]  # e8m0's range
    return Fp4Features(_block_codes(blocks, scale), scale, stored)


def _check_hidden_size(hidden_ND: torch.Tensor, kind: Fp4Kind) -> int:
    """`kind`'s block size, once the features' hidden size is checked to be a multiple of it."""
    block, D = BLOCK[kind], hidden_ND.shape[-1]
    if D % block:
        raise ValueError(
            f"{kind} rounds blocks of {block} features; this hidden size, {D}, is not a multiple"
        )
    return block


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

# The encoder's parts see the features as blocks, one a row of [M, 16] (M = tokens x D / 16),
# in the features' own dtype (each part reads them as fp32 itself: bf16 from a target is half
# the bytes of fp32 to read, and each candidate reads them once). Compiled, each part is one
# graph with one dynamic size, M, whatever the leading shape (an extract batch's [N, D], a
# training batch's [T, K, D]).


def nvfp4_block_amax(
    blocks_M16: torch.Tensor, blocks_per_row: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each block's amax [M, 1], its row's fp32 scale repeated for each block [M, 1], the rows'
    scales [M / blocks_per_row, 1]) of [M, 16] blocks, `blocks_per_row` (D / 16) to a row. A
    row's scale maps its amax to e2m1's 6 times e4m3's 448; an all-zero row's is 1."""
    amax_M1 = blocks_M16.float().abs().amax(-1, keepdim=True)
    per_row_N1 = amax_M1.reshape(-1, blocks_per_row).amax(-1, keepdim=True)
    per_row_N1 = per_row_N1 / (E2M1_MAX * E4M3_MAX)
    per_row_N1 = torch.where(per_row_N1 == 0, 1.0, per_row_N1)
    per_row_M1 = per_row_N1.expand(-1, blocks_per_row).reshape(-1, 1)
    return amax_M1, per_row_M1, per_row_N1


def nvfp4_candidate(
    blocks_M16: torch.Tensor,
    amax_M1: torch.Tensor,
    per_row_M1: torch.Tensor,
    top: torch.Tensor,
    step: torch.Tensor,
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block-scale candidate of [M, 16] blocks: the e4m3 scale mapping each block's amax
    to `top`, `step` e4m3 steps away (0-d tensors, so that one compiled graph serves all six),
    its block's float64 squared error under it, and the candidate kept against `best` (the
    bits and errors kept so far, and whether this is the first: `keep_least`). The codes it
    would give are not kept: only the chosen scale's are made (`_nvfp4_codes`), so six
    candidates cost six reads of the features and no copies of their codes."""
    e4m3 = (amax_M1 / top / per_row_M1).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    bits_M1 = (e4m3.view(torch.uint8).int() + step).clamp(0, E4M3_MAX_BITS).to(torch.uint8)
    scale_M1, codes_M16 = _nvfp4_codes(blocks_M16, bits_M1, per_row_M1)
    decoded = (e2m1_value(codes_M16) * scale_M1).double()
    error_M1 = (decoded - blocks_M16.double()).square().sum(-1, True)
    return keep_least(*best, bits_M1, error_M1)


def keep_least(
    best_bits: torch.Tensor,
    best_error: torch.Tensor,
    first: torch.Tensor,
    bits: torch.Tensor,
    error: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates compared in turn with `<`, one step: (bits, error) where `first` (0-d
    bool) or where `error` is less than `best_error`, else the best so far. So the earlier of
    equals stays, a NaN error never wins, and a NaN first error (a NaN feature) is never
    beaten."""
    wins = first | (error < best_error)
    return torch.where(wins, bits, best_bits), torch.where(wins, error, best_error)


def _nvfp4_codes(
    blocks_M16: torch.Tensor, bits_M1: torch.Tensor, per_row_M1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 decode scales [M, 1], codes [M, 16]) of blocks under e4m3 block-scale bits."""
    scale_M1 = bits_M1.view(torch.float8_e4m3fn).float() * per_row_M1
    return scale_M1, _block_codes(blocks_M16.float(), scale_M1)


def nvfp4_rows(
    blocks_M16: torch.Tensor, bits_M1: torch.Tensor, per_row_M1: torch.Tensor, blocks_per_row: int
) -> torch.Tensor:
    """The stored nvfp4 rows [M / blocks_per_row, nvfp4_row_bytes(D)] (`quantize_nvfp4`) of
    [M, 16] blocks under their chosen e4m3 block-scale bits."""
    codes_M16 = _nvfp4_codes(blocks_M16, bits_M1, per_row_M1)[1]
    packed_M8 = codes_M16[:, 0::2] | (codes_M16[:, 1::2] << 4)
    half = blocks_per_row * BLOCK["nvfp4"] // 2
    return torch.cat([packed_M8.reshape(-1, half), bits_M1.reshape(-1, blocks_per_row)], dim=-1)


@dataclass(frozen=True)
class Nvfp4Kernels:
    """The nvfp4 encoder's three parts over the features' blocks: their amax and row scales
    (`nvfp4_block_amax`), a block-scale candidate kept or not (`nvfp4_candidate`, six calls)
    and the chosen scales' rows (`nvfp4_rows`). Eager by default; `compiled_quantize_nvfp4`
    passes each as one compiled region."""

    block_amax: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = nvfp4_block_amax
    candidate: Callable[..., tuple[torch.Tensor, torch.Tensor]] = nvfp4_candidate
    rows: Callable[..., torch.Tensor] = nvfp4_rows


def _nvfp4_least_error_bits(
    blocks_M16: torch.Tensor, amax_M1: torch.Tensor, per_row_M1: torch.Tensor, candidate: Callable
) -> torch.Tensor:
    """The e4m3 block-scale bits [M, 1] of [M, 16] blocks: of NVFP4_SCALE_CANDIDATES, the first
    of least squared error (fp64) of the decoded block (FORMAT.md "Hidden states"), as
    `keep_least` compares them in turn."""
    device = blocks_M16.device
    best_bits = torch.zeros(amax_M1.shape, dtype=torch.uint8, device=device)
    best_error = torch.zeros(amax_M1.shape, dtype=torch.float64, device=device)
    for top, step, first in _candidate_tensors(device):
        best_bits, best_error = candidate(
            blocks_M16, amax_M1, per_row_M1, top, step, (best_bits, best_error, first)
        )
    return best_bits


@functools.cache
def _candidate_tensors(device: torch.device) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Each of NVFP4_SCALE_CANDIDATES as 0-d tensors on `device` (its target, its step, whether
    it is the first): a compiled graph then takes no host scalar among them, and one graph
    serves all six. Made once per device: a tensor made from a Python number on a GPU is a
    blocking copy that waits for the stream (18 of them a tapped layer, inside the target's
    forward). Outside inference mode, as extract's hook runs in it and training does not."""
    with torch.inference_mode(False):
        return tuple(
            (
                torch.tensor(top, device=device),
                torch.tensor(step, dtype=torch.int32, device=device),
                torch.tensor(k == 0, device=device),
            )
            for k, (top, step) in enumerate(NVFP4_SCALE_CANDIDATES)
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
    multiple of 16. `kernels`: the encoder's parts (default eager; `compiled_quantize_nvfp4`
    passes their compiled twins)."""
    block = _check_hidden_size(hidden_ND, "nvfp4")
    D, leading = hidden_ND.shape[-1], hidden_ND.shape[:-1]
    if hidden_ND.numel() == 0:  # no rows: the parts' reshapes by -1 cannot size nothing
        device = hidden_ND.device
        rows = torch.zeros((*leading, nvfp4_row_bytes(D)), dtype=torch.uint8, device=device)
        return rows, torch.ones(leading, device=device)
    if kernels is None or hidden_ND.numel() == D:
        # a single row eager: one row as M = D / 16 blocks would specialize a compiled graph
        # to it (its rows' count, 1, is guarded), and costs nothing
        kernels = Nvfp4Kernels()
    blocks_M16 = hidden_ND.reshape(-1, block)
    amax_M1, per_row_M1, per_row_N1 = kernels.block_amax(blocks_M16, D // block)
    bits_M1 = _nvfp4_least_error_bits(blocks_M16, amax_M1, per_row_M1, kernels.candidate)
    rows_NW = kernels.rows(blocks_M16, bits_M1, per_row_M1, D // block)
    return rows_NW.reshape(*leading, -1), per_row_N1.reshape(leading)


@functools.cache
def compiled_quantize_nvfp4() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`quantize_nvfp4` with its three parts compiled (extract's encoder where the head is
    compiled: a CUDA target's default): the blocks' amax and scales one region, each
    block-scale candidate another (its codes fused into its error and never written; one graph
    serves all six: their target, step and first flag are tensors), the chosen scales' rows a
    third; each serves every batch's token count (`rows_dynamic`). Eager, a candidate is ~30
    elementwise passes over the features. The same bytes as eager (`compiled_encoder`). The
    whole encoder as one region took 0.8x the time on an H100 (1.08 ms against 1.36 ms a layer
    at the 8B width, forty-first session) but 74 s to compile on this project's CPU against
    ~10 s, in every test run that encodes nvfp4; not taken. fullgraph: a graph break raises
    instead of running eager silently."""
    kernels = Nvfp4Kernels(
        block_amax=compiled_encoder(nvfp4_block_amax),
        candidate=compiled_encoder(nvfp4_candidate),
        rows=compiled_encoder(nvfp4_rows),
    )
    return functools.partial(quantize_nvfp4, kernels=kernels)


def compiled_encoder(encode: Callable[..., Any]) -> Callable[..., Any]:
    """A store encoder's part compiled whole (fullgraph: a graph break raises instead of running
    eager silently), for every row count (`rows_dynamic`), with IEEE-rounded fp32 division as
    eager's: Triton's default division is approximate, and on an H100 it moved 5,084 of 11,776
    nvfp4 rows (65 fp8 rows) off the bytes FORMAT.md's rule gives at rounding boundaries; with
    the option none (forty-first session), at +14% of the nvfp4 encoder's time (+0.2% of an 8B
    forward for five tapped layers). So a store's bytes follow the written rule on every device."""
    options = {"eager_numerics.division_rounding": True}
    return rows_dynamic(torch.compile(encode, fullgraph=True, options=options))


def rows_dynamic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` with its 2-D inputs' first size (rows: tokens, or blocks) marked dynamic
    before each call (those in a tuple argument too): one graph for every batch, the other
    sizes (a block's 16, a hidden size) static. dynamic=True made every size symbolic, the 16
    of nvfp4's per-block reduction included."""

    def call(*args: Any) -> Any:
        for arg in args:
            for tensor in arg if isinstance(arg, tuple) else (arg,):
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return compiled(*args)

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
