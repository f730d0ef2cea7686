"""`data.hidden_as_fp4`'s rounding (common/fp4.py) against references built
here value by value from the formats' definitions: e2m1's 15 signed values, MXFP4's
power-of-two scale per 32 features, NVFP4's e4m3 scale per 16 under an fp32 one per row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.fp4 import e2m1_code, e2m1_value, round_features_fp4
from common.store import decode_scaled_hidden, dequantize_fp8, quantize_fp8
from stage2_train.batch import Batch
from stage2_train.config import TrainConfig
from stage2_train.inputs import check_inputs

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1, codes 0-7 (OCP MX spec)


def nearest_e2m1(v: float) -> float:
    """The nearest e2m1 value by brute force over the grid; a tie goes to the even code;
    beyond 6, 6 (saturation)."""
    m = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(MAGNITUDES[c] - m), c % 2))
    return math.copysign(MAGNITUDES[best], v)


def test_e2m1_rounding_matches_the_grid_ties_to_even() -> None:
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    values = ties + [-t for t in ties] + [0.1, 0.26, 2.49, 5.9, 6.0, 7.5, 100.0, -1e-9, 0.0]
    values += torch.empty(2000).uniform_(-8, 8, generator=torch.Generator().manual_seed(0)).tolist()
    got = e2m1_value(e2m1_code(torch.tensor(values))).tolist()
    assert got == [nearest_e2m1(v) for v in values]
    # the ties land on even codes: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4
    assert got[:7] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def reference_mxfp4(row: list[float]) -> list[float]:
    out = []
    for start in range(0, len(row), 32):
        block = row[start : start + 32]
        amax = max(abs(v) for v in block)
        if amax == 0:
            out += [0.0] * len(block)
            continue
        scale = 2.0 ** (math.floor(math.log2(amax)) - 2)
        out += [nearest_e2m1(v / scale) * scale for v in block]
    return out


# every non-negative finite e4m3 value, in order (bits 0x00-0x7E)
E4M3_GRID = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()


def reference_nvfp4(row: list[float]) -> list[float]:
    """Each block under the e4m3 scale of least squared error among the one mapping its amax to
    6, the one mapping it to 4, and each one's neighbours on the e4m3 grid (the first such on
    a tie, in that order)."""
    per_row = max(abs(v) for v in row) / (6 * 448)
    out = []
    for start in range(0, len(row), 16):
        block = row[start : start + 16]
        candidates = []
        for top in (6, 4):
            wanted = min(max(abs(v) for v in block) / top / per_row, 448.0)
            index = E4M3_GRID.index(torch.tensor(wanted).to(torch.float8_e4m3fn).float().item())
            candidates += [E4M3_GRID[max(0, min(126, index + d))] for d in (0, -1, 1)]
        best, best_error = None, None
        for block_scale in candidates:
            scale = torch.tensor(block_scale * per_row, dtype=torch.float32).item()
            decoded = [nearest_e2m1(v / scale) * scale if scale else 0.0 for v in block]
            error = sum((d - v) ** 2 for d, v in zip(decoded, block, strict=True))
            if best_error is None or error < best_error:
                best, best_error = decoded, error
        out += best
    return out


@pytest.mark.parametrize("kind", ["mxfp4", "nvfp4"])
def test_blocks_match_the_reference(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    # rows of 64 features with a wide spread of magnitudes across blocks, a zero block, an outlier
    x = (
        torch.randn(6, 2, 64, generator=g)
        * torch.logspace(-3, 2, 64)[torch.randperm(64, generator=g)]
    )
    x[0, 0, :32] = 0
    x[1, 1, 5] = 300.0
    got = round_features_fp4(x, kind)  # type: ignore[arg-type]
    reference = reference_mxfp4 if kind == "mxfp4" else reference_nvfp4
    for t in range(x.shape[0]):
        for k in range(x.shape[1]):
            want = torch.tensor(reference(x[t, k].tolist()), dtype=torch.float32)
            torch.testing.assert_close(got[t, k], want, rtol=1e-6, atol=0)
    assert (got[0, 0, :32] == 0).all()


def test_mxfp4_results_are_exact_in_bf16() -> None:
    x = torch.randn(50, 3, 96, generator=torch.Generator().manual_seed(2)) * 7
    got = round_features_fp4(x, "mxfp4")
    assert torch.equal(got.to(torch.bfloat16).float(), got)


def test_bad_layouts_are_named() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        round_features_fp4(torch.ones(2, 40), "mxfp4")
    with pytest.raises(ValueError, match="unknown fp4 layout 'fp4'"):
        round_features_fp4(torch.ones(2, 32), "fp4")  # type: ignore[arg-type]


def _batch(hidden_TKD: torch.Tensor, scale_TK: torch.Tensor | None) -> Batch:
    T = hidden_TKD.shape[0]
    none = torch.zeros(0, dtype=torch.long)
    return Batch(
        indices=torch.zeros(1, dtype=torch.long),
        tokens_T=torch.zeros(T, dtype=torch.long),
        position_ids_T=torch.arange(T),
        document_ids_T=torch.zeros(T, dtype=torch.long),
        hidden_TKD=hidden_TKD,
        anchors_A=none,
        labels_AB=none,
        weights_AB=none,
        hidden_scale_TK=scale_TK,
    )


def test_a_batch_rounds_what_its_store_holds() -> None:
    """bf16 features are rounded as they are; an fp8 store's are decoded first (the features
    the drafter would otherwise see). mxfp4 gives the drafter bf16 and no scale; nvfp4 the rows
    and scales an nvfp4 store holds, which the step decodes as it decodes that store's."""
    x = (torch.randn(12, 3, 64, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    bits, scale = quantize_fp8(x)
    for kind in ("mxfp4", "nvfp4"):
        plain = _batch(x, None).rounded_as_configured(False, kind)
        from_fp8 = _batch(bits, scale).rounded_as_configured(False, kind)
        for batch, source in ((plain, x), (from_fp8, dequantize_fp8(bits, scale))):
            want = round_features_fp4(source, kind)
            if kind == "mxfp4":
                assert batch.hidden_scale_TK is None and batch.hidden_TKD.dtype == torch.bfloat16
                assert torch.equal(batch.hidden_TKD, want.to(torch.bfloat16))
            else:
                assert batch.hidden_TKD.shape == (12, 3, 36) and batch.hidden_scale_TK.shape == (
                    12,
                    3,
                )
                decoded = decode_scaled_hidden(
                    batch.hidden_TKD, batch.hidden_scale_TK, 64, torch.float32
                )
                assert torch.equal(decoded, want)
        assert not torch.equal(round_features_fp4(x, kind).to(torch.bfloat16), x)  # visible
    unchanged = _batch(x, None)
    assert unchanged.rounded_as_configured(False, "none") is unchanged


def test_a_hidden_size_off_the_block_is_refused_at_the_start(tmp_path: Path) -> None:
    """A hidden size that is no multiple of the layout's block fails in check_inputs, naming
    data.hidden_as_fp4 and the layout that would fit, not at the first step."""
    store = build_store(tmp_path / "s", FactorySpec(hidden_size=48, num_sequences=4))

    def cfg(kind: str) -> TrainConfig:
        sets = [f"data.store={store}", f"run.out={tmp_path / 'run'}", f"data.hidden_as_fp4={kind}"]
        return build_config(TrainConfig, "configs/debug.yaml", "train", sets)

    with pytest.raises(ValueError, match=r"hidden_as_fp4=mxfp4 .* hidden size 48 .* use nvfp4"):
        check_inputs(cfg("mxfp4"))
    check_inputs(cfg("nvfp4"))  # 48 = 3 blocks of 16


def test_least_error_pick_is_the_in_turn_comparison() -> None:
    """The six candidates' errors kept one by one (`keep_least`, inside each compiled
    candidate) as comparing them in turn with `<` picks: the first of equals, a later NaN
    never wins, a NaN first candidate is kept."""
    from common.fp4 import keep_least

    nan, inf = float("nan"), float("inf")
    errors = [  # one block per row, six candidates' errors
        [3.0, 2.0, 2.0, 5.0, 1.0, 1.0],  # least at 4 and 5: 4
        [1.0, nan, 0.5, nan, 0.5, 2.0],  # NaNs never win: 2
        [nan, 0.1, 0.0, 0.2, 0.3, 0.4],  # a NaN first is never beaten: 0
        [inf, inf, inf, inf, inf, inf],  # all equal: 0
        [inf, nan, 7.0, inf, nan, 7.0],  # 2
    ]

    def in_turn(row: list[float]) -> int:
        best = 0
        for k in range(1, len(row)):
            if row[k] < row[best]:
                best = k
        return best

    table = torch.tensor(errors, dtype=torch.float64)
    # the kept-so-far start as the encoder starts them: zeros, which the first replaces
    bits, error = torch.zeros(5, 1, dtype=torch.uint8), torch.zeros(5, 1, dtype=torch.float64)
    for k in range(table.shape[1]):  # the bits name the candidate
        candidate_bits = torch.full((5, 1), k, dtype=torch.uint8)
        bits, error = keep_least(
            bits, error, torch.tensor(k == 0), candidate_bits, table[:, k, None]
        )
    assert bits.flatten().tolist() == [in_turn(row) for row in errors] == [4, 2, 0, 0, 2]
