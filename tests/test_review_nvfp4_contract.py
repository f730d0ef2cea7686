"""FORMAT.md's "Hidden states" as a contract for nvfp4 stores: a numpy-only decoder and encoder
written from its words alone (row layout, nibble order, the e2m1 code table, e4m3 block scales,
the fp32 row scale), checked against the code's decoder (`decode_scaled_hidden`,
`dequantize_nvfp4`) and against the bytes `dflash extract` stores, on a tiny extracted store and
on synthetic rows with ties, zeros, values above the range, negative zero and a zero block.

Legend: N rows, D features of a row, W = D/2 + D/16 bytes of a stored row, B = D/16 blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from test_extract import cli_extract, write_data

import stage1_extract.target
from common.fp4 import dequantize_nvfp4
from common.store import decode_scaled_hidden, encode_hidden

F32 = np.float32
# FORMAT.md: "bits 0-2 the magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6"
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=F32)


def e4m3_value(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bits -> fp32: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    is subnormal, S.1111.111 is NaN, there is no infinity."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, F32(-1), F32(1))
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + man / 8) * np.exp2(exp - 7.0)
    value = np.where(exp == 0, man / 8 * 2.0**-6, normal).astype(F32)
    value = np.where((exp == 15) & (man == 7), F32(np.nan), value)
    return (sign * value).astype(F32)


E4M3_FINITE = e4m3_value(np.arange(127))  # the non-negative finite values, by their bits


def nearest_even(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index into the increasing `grid` of the value nearest each non-negative `x`, ties to the
    even index (beyond the grid's end: its last index)."""
    hi = np.clip(np.searchsorted(grid, x, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = x - grid[lo], grid[hi] - x
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(x >= grid[-1], len(grid) - 1, pick)


def e4m3_bits(x: np.ndarray) -> np.ndarray:
    """fp32 (non-negative) -> float8_e4m3fn bits, round to nearest even (448 at most)."""
    assert np.all(x >= 0)
    return nearest_even(np.minimum(x.astype(F32), F32(448)), E4M3_FINITE).astype(np.uint8)


def decode(hidden_NW: np.ndarray, scale_N: np.ndarray) -> np.ndarray:
    """FORMAT.md: `value(code[i]) * (float(block_scale[i // 16]) * hidden_scale)`, in fp32."""
    width = hidden_NW.shape[-1]
    assert width % 9 == 0, width
    d = width // 9 * 16
    packed = hidden_NW[..., : d // 2].astype(np.uint8)
    codes = np.empty((*hidden_NW.shape[:-1], d), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF  # feature 2i: the low nibble of byte i
    codes[..., 1::2] = packed >> 4
    value = np.where(codes & 8, F32(-1), F32(1)) * E2M1[codes & 7]
    block = np.repeat(e4m3_value(hidden_NW[..., d // 2 :]), 16, axis=-1)
    return value * (block * scale_N.astype(F32)[..., None])


def block_codes(h: np.ndarray, s: np.ndarray) -> np.ndarray:
    """FORMAT.md: "e2m1 code nearest h[i] / s, ties to the even code, clamped to +-6; 0 where s
    is 0"; bit 3 the sign bit of h[i]."""
    q = np.abs(h) / np.where(s == 0, F32(1), s)
    index = nearest_even(q, E2M1).astype(np.uint8)
    return np.where(s == 0, 0, index | np.where(np.signbit(h), 8, 0)).astype(np.uint8)


def encode(h_ND: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FORMAT.md's encoder: fp32 math, six candidate block scales, the first of least float64
    squared error."""
    h = h_ND.astype(F32)
    n, d = h.shape
    amax = np.abs(h).max(axis=-1)
    scale = amax / F32(6 * 448)
    scale = np.where(scale == 0, F32(1), scale).astype(F32)
    a = np.abs(h).reshape(n, d // 16, 16).max(axis=-1)
    best_bits = best_codes = best_error = None
    for top in (6, 4):
        # (the division by a numpy scalar keeps fp32: F32 over F32)
        base = e4m3_bits(a / F32(top) / scale[:, None]).astype(np.int64)
        for step in (0, -1, 1):
            bits = np.clip(base + step, 0x00, 0x7E).astype(np.uint8)
            s = np.repeat(e4m3_value(bits), 16, axis=-1) * scale[:, None]
            codes = block_codes(h, s)
            value = np.where(codes & 8, F32(-1), F32(1)) * E2M1[codes & 7]
            wrong = (value * s).astype(np.float64) - h.astype(np.float64)
            error = np.square(wrong).reshape(n, d // 16, 16).sum(axis=-1)
            if best_error is None:
                best_bits, best_codes, best_error = bits, codes, error
                continue
            better = error < best_error  # a NaN error is never less
            best_bits = np.where(better, bits, best_bits)
            best_codes = np.where(np.repeat(better, 16, axis=-1), codes, best_codes)
            best_error = np.where(better, error, best_error)
    packed = best_codes[:, 0::2] | (best_codes[:, 1::2] << 4)
    return np.concatenate([packed, best_bits], axis=-1).astype(np.uint8), scale


def code_decoders(hidden_NW: np.ndarray, scale_N: np.ndarray, d: int) -> list[np.ndarray]:
    rows, scale = torch.from_numpy(hidden_NW), torch.from_numpy(scale_N)
    return [
        decode_scaled_hidden(rows, scale, d, torch.float32).numpy(),
        dequantize_nvfp4(rows, scale).numpy(),
    ]


def synthetic_rows() -> np.ndarray:
    """Rows of 64 features: block scales of exact e4m3 values (row amax 2688: row scale 1)
    with every e2m1 tie, values whose block scale rounds down (above the range: clamped),
    negative zero, negatives that round to zero, a zero block, a block of subnormal or zero
    scale, a zero row; then random rows of many magnitudes (subnormal row scales and block
    products that underflow among them) and heavy tails."""
    rows = []
    r = np.zeros(64, dtype=F32)
    r[0] = 2688  # block 0: scale 448
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6], dtype=F32)
    r[16:24], r[24:32] = 2 * ties, -2 * ties  # block 1: amax 12 -> block scale 2
    r[32:48] = [56.4, 56, -56.4, 40, -0.0, 0.0, -0.1, 0.1, -0.5, 0.5, 3, -3, 0, 0, 0, 0]
    rows.append(r)  # block 3 (48:64) all zeros
    # blocks where amax -> 6 (c6) is the least-error candidate: values on its grid and a few
    # ties (row 1), and one whose block scale 9.4 rounds down to 9 (56.4 / 9 clamps to 6)
    r = np.zeros(64, dtype=F32)
    r[0] = 2688
    grid = [12, 8, 6, 4, 3, 2, 1]
    r[16:32] = grid + grid[:-1] + [0.5, 1.5, -2.5]  # block scale 2
    r[32:48] = grid + grid + [0, 7]
    r[48:64] = [56.4, 54, 36, 27, 18, 13.5, 9, 4.5] * 2
    rows.append(r)
    r = np.zeros(64, dtype=F32)
    r[:16] = np.linspace(-300, 300, 16)
    r[16:32] = 1e-4 * np.arange(16)  # block scale subnormal (or zero)
    r[32:48] = 1e-9
    r[48] = -0.0
    rows.append(r)
    rows.append(np.zeros(64, dtype=F32))
    rows.append(-np.zeros(64, dtype=F32))
    rng = np.random.default_rng(0)
    for magnitude in (1e-44, 1e-41, 1e-38, 1e-36, 1e-30, 1e-6, 1.0, 37.0, 1e4, 1e30, 1e37):
        rows.append((rng.standard_normal(64) * magnitude).astype(F32))
        rows.append(np.clip(rng.standard_t(1.5, 64) * magnitude, -3e38, 3e38).astype(F32))
    return np.stack(rows)


def test_decoder_of_the_words_is_the_codes_on_every_byte() -> None:
    """Random bytes (every code, every e4m3 block scale, NaNs included) under random row
    scales decode the same through FORMAT.md's words and the code's decoders."""
    rng = np.random.default_rng(1)
    hidden_NW = rng.integers(0, 256, (512, 72), dtype=np.uint8)
    hidden_NW[:32, 64:] = np.arange(256, dtype=np.uint8).reshape(32, 8)  # every block scale
    scale_N = (rng.standard_normal(512) * 10.0 ** rng.integers(-20, 20, 512)).astype(F32)
    scale_N[:3] = [1.0, 0.0, 2.0**-126]
    want = decode(hidden_NW, scale_N)
    for got in code_decoders(hidden_NW, scale_N, 128):
        np.testing.assert_array_equal(got, want)


def test_encoder_of_the_words_writes_the_codes_bytes() -> None:
    h_ND = synthetic_rows()
    rows, scale = encode_hidden(torch.from_numpy(h_ND), "nvfp4")
    want_rows, want_scale = encode(h_ND)
    np.testing.assert_array_equal(scale.numpy(), want_scale)
    np.testing.assert_array_equal(rows.numpy(), want_rows)
    for got in code_decoders(want_rows, want_scale, 64):
        np.testing.assert_array_equal(got, decode(want_rows, want_scale))
    # row 0: a block of every tie took the scale 3.25 (amax 12 -> 4, one e4m3 step up: less
    # error than 2, where every value is a tie); [56.4, 56, -56.4, 40, ...] took 14 (12.4 ->
    # 4); -0.0, -0.1, -0.5 and -3 (under a quarter step of 14) are code 8, +0.0, 0.1, 0.5 and 3
    # code 0; a zero block
    decoded = decode(want_rows, want_scale)
    assert e4m3_value(want_rows[0, 32:]).tolist() == [448, 3.25, 14, 0]
    assert decoded[0, 32:36].tolist() == [56, 56, -56, 42]
    assert want_rows[0, 18:22].tolist() == [0x08, 0x08, 0x08, 0x80]
    assert want_rows[0, 32 + 3] == 0
    # row 1: the amax -> 6 scales won; the ties went to the even code (0.5 -> 0, 1.5 -> 2,
    # -2.5 -> -2, 7 -> 8) and 56.4 / 9 clamped to 6
    assert e4m3_value(want_rows[1, 32:]).tolist() == [448, 2, 2, 9]
    assert decoded[1, 29:32].tolist() == [0, 2, -2] and decoded[1, 47] == 8
    assert decoded[1, 48:56].tolist() == [54, 54, 36, 27, 18, 13.5, 9, 4.5]


@pytest.fixture(scope="module")
def extracted(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory):
    """A tiny nvfp4 extraction, with every (input, rows, scale) its encoder was given and gave."""
    folder = tmp_path_factory.mktemp("nvfp4-contract")
    calls = []
    encode_hidden_ = stage1_extract.target.encode_hidden

    def spy(hidden_ND: torch.Tensor, dtype: str, *args):
        rows, scale = encode_hidden_(hidden_ND, dtype, *args)
        calls.append((hidden_ND.float().numpy().copy(), rows.numpy().copy(), scale.numpy()))
        return rows, scale

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage1_extract.target, "encode_hidden", spy)
        sets = ["store.hidden_dtype=nvfp4", "target.tapped_layers=[0,1,3]"]
        result = cli_extract(tiny_qwen3, write_data(folder), folder / "store", *sets)
    assert result.exit_code == 0, result.output
    return folder / "store", calls


def test_extracted_store_decodes_and_encodes_by_the_words(extracted) -> None:
    store, calls = extracted
    assert calls and all(h.dtype == np.float32 for h, _, _ in calls)
    made = set()
    for h_ND, rows, scale in calls:
        want_rows, want_scale = encode(h_ND)
        np.testing.assert_array_equal(rows, want_rows)
        np.testing.assert_array_equal(scale, want_scale)
        made.update(bytes(r) + s.tobytes() for r, s in zip(want_rows, want_scale, strict=True))
    num_real = 0
    for shard in sorted((store / "shards").iterdir()):
        group = zarr.open_group(shard, mode="r")
        hidden, scale = group["hidden"][...], group["hidden_scale"][...]
        assert hidden.dtype == np.uint8 and hidden.shape[-1] == 64 // 2 + 64 // 16
        assert scale.dtype == np.float32 and scale.shape == hidden.shape[:-1]
        real = group["document_ids"][...] >= 0
        for row, s in zip(hidden[real].reshape(-1, 36), scale[real].reshape(-1), strict=True):
            assert bytes(row) + s.tobytes() in made
            num_real += 1
        assert not hidden[~real].any() and np.all(scale[~real] == 1)
        for k in range(hidden.shape[2]):
            want = decode(hidden[:, :, k], scale[:, :, k])
            for got in code_decoders(hidden[:, :, k], scale[:, :, k], 64):
                np.testing.assert_array_equal(got, want)
    assert num_real > 0
