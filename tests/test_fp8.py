"""FP8 hidden states (`store.hidden_dtype=float8_e4m3fn`), end to end: the quantizer's error
bound, an fp8 extraction against a fresh forward of each document, the bytes it saves, the
content key, training from an fp8 store, `inspect verify` on fp8 stores, and stores whose
hidden_dtype this code does not know."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from store_factory import FactorySpec, build_store
from test_extract import cli_extract, fresh_forwards, make_config, shard_arrays, write_data
from transformers import AutoModelForCausalLM

from common.config import build_config
from common.inspect_store import summarize
from common.inspect_verify import verify_store
from common.store import StoreError, dequantize_fp8, encode_hidden, open_store, quantize_fp8
from dflash_offline.cli import main as cli
from stage1_extract.run import run_extract
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences, collate
from stage2_train.train import run_train

FP8 = "store.hidden_dtype=float8_e4m3fn"
LAYERS = "target.tapped_layers=[0,1,3]"  # 3 is the last layer: stored after the final norm
TRAIN_DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


def fp8_ordinal(bits: torch.Tensor) -> torch.Tensor:
    """uint8 fp8 bits -> integers in value order: neighbouring fp8 values differ by 1."""
    magnitude = (bits & 0x7F).long()
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def test_round_trip_error_bound_with_layers_of_very_different_magnitude() -> None:
    gen = torch.Generator().manual_seed(0)
    # 5 "layers" from 1e-3 to 1e3, heavy-tailed rows, a padding token and one zero row
    magnitude_K = torch.logspace(-3, 3, 5)
    x = torch.randn(64, 5, 256, generator=gen) * magnitude_K[None, :, None]
    x *= torch.rand(64, 5, 256, generator=gen).pow(4) * 4
    x[7] = 0.0
    x[9, 1] = 0.0
    bits, scale = quantize_fp8(x)
    assert bits.dtype == torch.uint8 and bits.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (64, 5)
    x_hat = dequantize_fp8(bits, scale)
    amax = x.abs().amax(-1, keepdim=True)
    # y = x / scale lies in [-448, 448]. e4m3 keeps 3 mantissa bits: a normal y rounds to within
    # 2^-4 |y|; below 2^-6 (subnormals) the step is 2^-9, so the error is at most 2^-10 in y
    # units = 2^-10 * amax / 448 < 2^-18 amax. The fp32 division and product add ~2^-23 |x|.
    bound = x.abs() * (2**-4 + 2**-20) + amax * 2**-18
    assert ((x - x_hat).abs() <= bound).all()
    # and the bound is nearly reached: it is the right one, not a loose one
    assert ((x - x_hat).abs() / x.abs().clamp_min(1e-30)).max() > 2**-4 * 0.9
    # per layer and token: a quiet layer keeps its own resolution next to a loud one
    rows = amax.squeeze(-1) > 0
    row_error = ((x - x_hat).abs().amax(-1) / amax.squeeze(-1).clamp_min(1e-30))[rows]
    assert row_error.max() <= 2**-4
    # each row's largest magnitude is the largest finite fp8, 448
    decoded = bits.view(torch.float8_e4m3fn).float().abs().amax(-1)
    assert (decoded[rows] == 448.0).all()
    # zero rows: scale 1, zero bits, decode to 0
    assert (scale[7] == 1).all() and (bits[7] == 0).all() and (scale[9, 1] == 1)
    assert (x_hat[7] == 0).all() and (x_hat[9, 1] == 0).all()
    # bf16 input (the GPU case) is quantized in fp32: the same bits as its fp32 value
    x_bf16 = x.to(torch.bfloat16)
    assert torch.equal(quantize_fp8(x_bf16)[0], quantize_fp8(x_bf16.float())[0])


@pytest.mark.slow
def test_the_compiled_fp8_encoder_writes_eagers_bytes() -> None:
    """Extract's fp8 encoder where the head is compiled (a CUDA target's default): the same
    bits and scales as eager on the CPU, fp32 and bf16 features, a zero row's included, one
    graph per input dtype for every token count (a single row runs eager); a row with a NaN
    has a NaN scale both ways (its bits mean nothing: verify flags the row)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        for tokens in (37, 300, 5, 1):
            x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)) * 10
            if tokens > 1:
                x[1] = 0.0
                x[-1, 3] = float("nan")
            for features in (x, x.bfloat16()):
                got_bits, got_scale = encode_hidden(features, "float8_e4m3fn", compiled=True)
                want_bits, want_scale = encode_hidden(features, "float8_e4m3fn")
                finite = want_scale.isfinite()
                assert finite.sum() == tokens - (tokens > 1) and got_scale[~finite].isnan().all()
                assert torch.equal(got_bits[finite], want_bits[finite])
                assert torch.equal(got_scale[finite], want_scale[finite])
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def fp8_store(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("extract-fp8")
    run_extract(make_config(tiny_qwen3, write_data(folder), folder / "store", LAYERS, FP8))
    return folder / "store"


def test_fp8_store_equals_quantized_fresh_forward(fp8_store: Path, tiny_qwen3: Path) -> None:
    info = open_store(fp8_store, require_complete=True)
    assert info.hidden_dtype == "float8_e4m3fn" and info.tapped_layers == [0, 1, 3]
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    for index in range(info.num_shards):
        a = shard_arrays(fp8_store, index)
        assert a["hidden"].dtype == np.uint8 and a["hidden_scale"].dtype == np.float32
        assert a["hidden_scale"].shape == a["hidden"].shape[:3]
        padding = a["document_ids"] < 0
        assert (a["hidden"][padding] == 0).all() and (a["hidden_scale"][padding] == 1).all()
    checked = exact = total = 0
    for a, seq, span, ref in fresh_forwards(fp8_store, model):
        want_LKD = torch.stack(
            [ref.hidden_states[i + 1][0] for i in info.tapped_layers],
            dim=1,
        )
        want_bits, want_scale = quantize_fp8(want_LKD)
        got_bits = torch.from_numpy(a["hidden"][seq, span])
        got_scale = torch.from_numpy(a["hidden_scale"][seq, span])
        torch.testing.assert_close(got_scale, want_scale, rtol=1e-5, atol=0.0)
        steps = (fp8_ordinal(got_bits) - fp8_ordinal(want_bits)).abs()
        assert steps.max() <= 1, f"sequence {seq}, tokens {span}: {steps.max()} steps"
        exact += int((steps == 0).sum())
        total += steps.numel()
        checked += 1
    assert checked == info.attrs["counts"]["documents"] > info.num_shards
    assert exact > 0.99 * total  # a batched forward differs from a lone one in rare roundings


def test_fp8_halves_the_hidden_bytes_and_verifies(fp8_store: Path) -> None:
    summary = summarize(open_store(fp8_store))
    arrays = summary["arrays"]
    assert arrays["hidden"]["dtype"] == "uint8" and arrays["hidden_scale"]["dtype"] == "float32"
    hidden = zarr.open_array(str(fp8_store / "shards" / "shard-000000" / "hidden"), mode="r")
    S, K, D = hidden.shape[1:]
    # what the same tokens' bf16 `hidden` would hold, uncompressed: positions x K x D x 2 bytes
    bf16_bytes = summary["sequences"] * S * K * D * 2
    for kind in ("uncompressed", "stored"):
        fp8_bytes = arrays["hidden"][kind] + arrays["hidden_scale"][kind]
        assert fp8_bytes < 0.6 * bf16_bytes, (kind, fp8_bytes, bf16_bytes)
    assert summary["provenance"]["hidden_dtype"] == "float8_e4m3fn"
    result = CliRunner().invoke(cli, ["inspect", str(fp8_store)])
    assert result.exit_code == 0 and "stored as float8_e4m3fn" in result.output
    report = verify_store(fp8_store)
    assert report["ok"], report["problems"]


def test_rerun_with_another_hidden_dtype_is_refused(
    fp8_store: Path, tiny_qwen3: Path, tmp_path: Path
) -> None:
    store = Path(shutil.copytree(fp8_store, tmp_path / "store"))
    data = fp8_store.parent / "data.jsonl"  # the same file: the data path is part of the key
    result = cli_extract(tiny_qwen3, data, store, LAYERS, "store.hidden_dtype=bfloat16")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "hidden_dtype" in message and "--overwrite" in message
    result = cli_extract(tiny_qwen3, data, store, LAYERS, FP8)  # same settings: resumes
    assert result.exit_code == 0, result.output


def test_training_from_an_fp8_store_learns(tmp_path: Path) -> None:
    store = build_store(
        tmp_path / "store", FactorySpec(num_sequences=13, hidden_dtype="float8_e4m3fn")
    )
    out = tmp_path / "run"
    sets = [f"data.store={store}", f"run.out={out}", "run.progress=false", "optim.epochs=3"]
    run_train(build_config(TrainConfig, TRAIN_DEBUG, "train", sets))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 33 and all(r["loss"] == r["loss"] for r in rows)  # 11 x 3, no NaN
    first = sum(r["loss"] for r in rows[:6]) / 6
    last = sum(r["loss"] for r in rows[-6:]) / 6
    assert last < 0.7 * first, (first, last)


def test_loader_ships_fp8_bits_that_decode_to_the_features(tmp_path: Path) -> None:
    """The same factory data stored both ways: decoded fp8 batches match the bf16 ones."""
    bf16 = build_store(tmp_path / "bf16", FactorySpec())
    fp8 = build_store(tmp_path / "fp8", FactorySpec(hidden_dtype="float8_e4m3fn"))
    args = dict(num_anchors=8, per_document=False, block_size=4, label_target="argmax")
    args |= dict(distill=False, seed=0)
    keys = [(0, 0, False), (6, 0, False)]
    a = collate([StoreSequences(open_store(bf16), **args)[k] for k in keys])
    b = collate([StoreSequences(open_store(fp8), **args)[k] for k in keys])
    assert a.hidden_scale_TK is None and a.hidden_TKD.dtype == torch.bfloat16
    assert b.hidden_TKD.dtype == torch.uint8 and b.hidden_scale_TK.shape == b.hidden_TKD.shape[:2]
    assert torch.equal(a.tokens_T, b.tokens_T) and torch.equal(a.labels_AB, b.labels_AB)
    want = a.hidden_TKD.float()
    got = dequantize_fp8(b.hidden_TKD, b.hidden_scale_TK)
    amax = want.abs().amax(-1, keepdim=True)
    assert ((got - want).abs() <= amax * (2**-4 + 2**-8)).all()  # fp8 step + bf16 rounding


SHARD0 = Path("shards") / "shard-000000"


def _padding_token(store: Path) -> tuple[int, int]:
    ids = zarr.open_array(str(store / SHARD0 / "document_ids"), mode="r")[...]
    seq, tok = np.argwhere(ids < 0)[0]
    return int(seq), int(tok)


FP8_CORRUPTIONS = {
    "nan_scale": ("hidden_scale", lambda s: (0, 5, 1), float("nan"), "1 NaN/Inf values"),
    "negative_scale": ("hidden_scale", lambda s: (1, 2, 0), -0.5, "1 zero or negative scales"),
    "nan_bits": ("hidden", lambda s: (0, 4, 1, 3), 0x7F, "1 NaN/Inf values"),  # e4m3fn NaN
    "padding_bits": (
        "hidden",
        lambda s: (*_padding_token(s), 0, 0),
        0x38,  # 1.0
        "1 padding tokens with non-zero values",
    ),
}


@pytest.mark.parametrize("case", FP8_CORRUPTIONS)
def test_verify_checks_fp8_hidden_and_scales(tmp_path: Path, case: str) -> None:
    store = build_store(tmp_path / "store", FactorySpec(hidden_dtype="float8_e4m3fn"))
    assert verify_store(store)["ok"]
    array, where, value, reason = FP8_CORRUPTIONS[case]
    zarr.open_array(str(store / SHARD0 / array), mode="r+")[where(store)] = value
    problems = verify_store(store)["problems"]
    assert len(problems) == 1, problems
    assert (problems[0]["shard"], problems[0]["array"]) == ("shard-000000", array)
    assert problems[0]["problem"].startswith(reason), problems[0]


def test_verify_reports_a_missing_hidden_scale(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", FactorySpec(hidden_dtype="float8_e4m3fn"))
    shutil.rmtree(store / SHARD0 / "hidden_scale")
    problems = verify_store(store)["problems"]
    assert [(p["array"], p["problem"]) for p in problems] == [("hidden_scale", "array missing")]


def test_unknown_hidden_dtype_is_rejected(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", FactorySpec())
    meta = store / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["dflash"]["hidden_dtype"] = "float4"
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="hidden_dtype 'float4' is not one this"):
        open_store(store)
    for command in (["inspect"], ["inspect", "verify"]):
        result = CliRunner().invoke(cli, [*command, str(store)])
        assert result.exit_code == 2
        message = " ".join(result.output.split())
        assert "hidden_dtype 'float4'" in message and "bfloat16, float8_e4m3fn" in message
    sets = [f"data.store={store}", f"run.out={tmp_path / 'run'}", "run.progress=false"]
    with pytest.raises(ValueError, match="float4"):
        run_train(build_config(TrainConfig, TRAIN_DEBUG, "train", sets))
