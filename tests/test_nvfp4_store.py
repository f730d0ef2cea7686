"""4-bit stores (`store.hidden_dtype=nvfp4`): the row layout FORMAT.md documents, built here
byte by byte; what extract, import and train refuse; `inspect verify` on such stores; a subset
of tapped layers read from one; and `dflash convert` decoding it. That an nvfp4 store trains as
the bf16 store rounded in the loader is tests/test_hidden_as_fp8.py's."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner
from store_factory import FactorySpec, build_store
from test_convert import convert, import_store, write_input
from test_extract import cli_extract, write_data

from common.config import build_config
from common.fp4 import dequantize_nvfp4, nvfp4_row_bytes, quantize_nvfp4, round_features_fp4
from common.inspect_verify import verify_store
from common.store import bits_to_bf16, decode_scaled_hidden, encode_hidden, open_store
from common.tiny import build_tiny_target
from dflash_offline.cli import main as cli
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences
from stage2_train.inputs import check_inputs

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
SHARD0 = Path("shards") / "shard-000000"


def test_a_row_is_codes_low_nibble_first_then_e4m3_block_scales() -> None:
    """Built from FORMAT.md's words: feature 2i in the low nibble of byte i, 2i + 1 in the high
    one, e2m1 codes (sign in bit 3); then one float8_e4m3fn byte per block of 16 features; the
    fp32 scale per row is amax / (6 * 448)."""
    x = torch.zeros(32)
    x[0], x[1] = 0.5, -6.0  # block 0: amax 6, so its e4m3 scale is 448 (0x7E)
    x[16], x[17] = 1.0, 3.0  # block 1: amax 3, scale 224 (0x76): 1, 3 -> 2, 6 (codes 4, 7)
    rows, scale = quantize_nvfp4(x)
    assert rows.dtype == torch.uint8 and rows.shape == (nvfp4_row_bytes(32),) == (18,)
    assert scale.shape == () and scale.item() == pytest.approx(6 / (6 * 448), rel=1e-7)
    want = [0xF1, 0, 0, 0, 0, 0, 0, 0, 0x74, 0, 0, 0, 0, 0, 0, 0, 0x7E, 0x76]
    assert rows.tolist() == want
    assert dequantize_nvfp4(rows, scale)[[0, 1, 16, 17]].tolist() == [0.5, -6.0, 1.0, 3.0]


def test_encoding_decodes_to_the_rounding_train_measures() -> None:
    """Rows of layers of very different magnitudes, a zero row and a NaN row: the decode is
    exactly `round_features_fp4(x, "nvfp4")`; zeros decode to zeros under scale 1; a NaN row
    shows in its scale (what extract's finiteness check and `inspect verify` read)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, 64, generator=gen) * torch.logspace(-3, 3, 5)[None, :, None]
    x[2] = 0.0
    rows, scale = encode_hidden(x, "nvfp4")
    assert rows.shape == (8, 5, 36) and scale.shape == (8, 5)
    assert torch.equal(dequantize_nvfp4(rows, scale), round_features_fp4(x, "nvfp4"))
    assert torch.equal(
        decode_scaled_hidden(rows, scale, 64, torch.float32), dequantize_nvfp4(rows, scale)
    )
    assert (rows[2] == 0).all() and (scale[2] == 1).all()
    x[3, 1, 7] = float("nan")
    assert math.isnan(encode_hidden(x, "nvfp4")[1][3, 1].item())
    with pytest.raises(ValueError, match="neither fp8 nor nvfp4 rows of hidden size 64"):
        decode_scaled_hidden(rows[..., :35], scale, 64, torch.float32)


def test_extract_and_import_refuse_a_hidden_size_off_the_block(tmp_path: Path) -> None:
    target = build_tiny_target(tmp_path / "target", hidden_size=40)
    data = write_data(tmp_path)
    result = cli_extract(target, data, tmp_path / "store")  # nvfp4: the default
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "hidden size 40 is not a multiple" in message
    assert "--set store.hidden_dtype=float8_e4m3fn (one byte a feature) or bfloat16" in message
    assert not (tmp_path / "store").exists()
    fp8 = cli_extract(target, data, tmp_path / "store", "store.hidden_dtype=float8_e4m3fn")
    assert fp8.exit_code == 0, fp8.output
    store = build_store(tmp_path / "s40", FactorySpec(hidden_size=40, num_sequences=4))
    write_input(store, tmp_path / "in.h5", verifier=True, head=True)
    code, out = convert(tmp_path / "in.h5", tmp_path / "imported", "--hidden-dtype", "nvfp4")
    message = " ".join(out.split())
    assert code == 2 and "--hidden-dtype=nvfp4 stores blocks of 16" in message
    assert "not a multiple: --hidden-dtype float8_e4m3fn (one byte a feature)" in message


def test_an_fp8_store_from_before_the_nvfp4_default_resumes_with_its_set(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """A store begun under the old default (fp8, the thirteenth to the fortieth session) and
    rerun with its old command: refused, never mixed, with the `--set` that resumes it."""
    data, out = write_data(tmp_path), tmp_path / "store"
    fp8 = "store.hidden_dtype=float8_e4m3fn"
    first = cli_extract(tiny_qwen3, data, out, fp8, "data.max_samples=4")
    assert first.exit_code == 0, first.output
    again = cli_extract(tiny_qwen3, data, out, "data.max_samples=4")
    message = " ".join(again.output.split())
    assert (
        again.exit_code == 2
        and "(store.hidden_dtype ('float8_e4m3fn' -> 'nvfp4') differ)" in message
    ), message
    assert "to resume it, rerun with --set store.hidden_dtype=float8_e4m3fn" in message, message
    assert open_store(out).hidden_dtype == "float8_e4m3fn"
    resumed = cli_extract(tiny_qwen3, data, out, "data.max_samples=4", fp8)
    assert resumed.exit_code == 0, resumed.output


def test_train_refuses_rounding_an_nvfp4_store_again(tmp_path: Path) -> None:
    store = build_store(tmp_path / "s", FactorySpec(num_sequences=6, hidden_dtype="nvfp4"))
    for option in (
        "data.hidden_as_fp4=nvfp4",
        "data.hidden_as_fp4=mxfp4",
        "data.hidden_as_fp8=true",
    ):
        sets = [f"data.store={store}", f"run.out={tmp_path / 'run'}", option]
        with pytest.raises(ValueError, match="holds nvfp4 features already") as err:
            check_inputs(build_config(TrainConfig, DEBUG, "train", sets))
        assert option in str(err.value)


@pytest.fixture
def nvfp4_store(tmp_path: Path) -> Path:
    return build_store(tmp_path / "store", FactorySpec(num_sequences=6, hidden_dtype="nvfp4"))


def test_verify_finds_a_nan_block_scale_and_nothing_in_codes(nvfp4_store: Path) -> None:
    """Any code byte is a finite pair of values; a block scale byte of 0x7F is an e4m3 NaN."""
    assert verify_store(nvfp4_store)["ok"]
    hidden = zarr.open_array(str(nvfp4_store / SHARD0 / "hidden"), mode="r+")
    real = np.argwhere(zarr.open_array(str(nvfp4_store / SHARD0 / "document_ids"))[...] >= 0)
    seq, tok = (int(v) for v in real[0])
    hidden[seq, tok, 0, 0] = 0xFF  # codes 15, 15: -6, -6
    assert verify_store(nvfp4_store)["ok"]
    hidden[seq, tok, 1, 32] = 0x7F  # the first block scale of layer 1
    problems = verify_store(nvfp4_store)["problems"]
    assert [p["array"] for p in problems] == ["hidden"]
    assert problems[0]["problem"].startswith(
        f"1 NaN/Inf values (first at sequence {seq}, token {tok})"
    )


def test_a_subset_of_layers_reads_those_layers_rows(nvfp4_store: Path) -> None:
    info = open_store(nvfp4_store)
    options = {
        "num_anchors": 4,
        "per_document": False,
        "block_size": 4,
        "label_target": "data",
        "distill": False,
        "seed": 0,
    }
    whole = StoreSequences(info, **options)[(0, 0, False)]
    chosen = StoreSequences(info, **options, layers=[info.tapped_layers[-1]])[(0, 0, False)]
    assert whole["hidden_SKD"].shape[1:] == (len(info.tapped_layers), 36)
    assert torch.equal(chosen["hidden_SKD"], whole["hidden_SKD"][:, -1:])
    assert torch.equal(chosen["hidden_scale_SK"], whole["hidden_scale_SK"][:, -1:])


def test_convert_writes_rows_or_decoded_features(nvfp4_store: Path, tmp_path: Path) -> None:
    code, out = convert(nvfp4_store, tmp_path / "rows.h5")
    assert code == 0, out
    with h5py.File(tmp_path / "rows.h5", "r") as f:
        assert f["hidden"].attrs["encoding"] == "nvfp4-rows" and f["hidden"].shape[-1] == 36
        rows, scale = torch.from_numpy(f["hidden"][...]), torch.from_numpy(f["hidden_scale"][...])
    code, out = convert(nvfp4_store, tmp_path / "f32.h5", "--hidden-as", "float32")
    assert code == 0, out
    with h5py.File(tmp_path / "f32.h5", "r") as f:
        assert "hidden_scale" not in f and f["hidden"].dtype == np.float32
        assert f["hidden"].attrs["encoding"] == "float32 (decoded from nvfp4 and hidden_scale)"
        assert torch.equal(torch.from_numpy(f["hidden"][...]), dequantize_nvfp4(rows, scale))


def test_import_encodes_the_files_features(tmp_path: Path) -> None:
    """An HDF5 file imported with --hidden-dtype nvfp4 holds its features encoded: the same
    file imported as bf16, rounded, decodes to the same values."""
    source = build_store(tmp_path / "source", FactorySpec(num_sequences=6))
    write_input(source, tmp_path / "in.h5", verifier=True, head=True)
    stores = {}
    for dtype in ("bfloat16", "nvfp4"):
        stores[dtype] = import_store(tmp_path / "in.h5", tmp_path / dtype, "--hidden-dtype", dtype)
    assert open_store(stores["nvfp4"]).hidden_dtype == "nvfp4"
    for index in range(open_store(stores["nvfp4"]).num_shards):
        name = f"shard-{index:06d}"
        got = zarr.open_group(stores["nvfp4"] / "shards" / name, mode="r")
        plain = zarr.open_group(stores["bfloat16"] / "shards" / name, mode="r")
        rows = torch.from_numpy(got["hidden"][...])
        decoded = dequantize_nvfp4(rows, torch.from_numpy(got["hidden_scale"][...]))
        want = round_features_fp4(bits_to_bf16(plain["hidden"][...]), "nvfp4")
        assert torch.equal(decoded, want)
    result = CliRunner().invoke(cli, ["inspect", str(stores["nvfp4"])])
    assert result.exit_code == 0 and "stored as nvfp4" in result.output


@pytest.mark.slow
def test_the_compiled_encoder_writes_eagers_bytes() -> None:
    """Extract's encoder where the head is compiled (a CUDA target's default): one graph for
    every token count and leading shape (a single row runs eager), the same rows and scales as
    eager (on the CPU), a zero row's included; a row with a NaN has a NaN scale both ways (its
    codes mean nothing: verify flags the row)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        one = torch.randn(1, 128, generator=torch.Generator().manual_seed(1)) * 30
        assert all(
            map(
                torch.equal, encode_hidden(one, "nvfp4", compiled=True), encode_hidden(one, "nvfp4")
            )
        )
        for tokens in (37, 300, 5):
            x = torch.randn(tokens, 3, 128, generator=torch.Generator().manual_seed(tokens)) * 30
            x[1] = 0.0
            x[2, 1, 5] = float("nan")
            got_rows, got_scale = encode_hidden(x, "nvfp4", compiled=True)
            want_rows, want_scale = encode_hidden(x, "nvfp4")
            finite = want_scale.isfinite()
            assert finite.sum() == 3 * tokens - 1 and got_scale[2, 1].isnan()
            assert torch.equal(got_rows[finite], want_rows[finite])
            assert torch.equal(got_scale[finite], want_scale[finite])
        # the amax', the candidate's and the rows' graphs, each compiled once for every shape
        assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_the_compiled_decoder_gives_eagers_values() -> None:
    """Training's decode on a GPU (`decode_scaled_hidden(..., compiled=True)`): the same values
    as the eager decode for fp8 and nvfp4 batches of any token count and leading shape, in fp32
    and bf16, zero rows included; one graph per store dtype and compute dtype, not per batch
    (a single row runs eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        for dtype in ("nvfp4", "float8_e4m3fn"):
            for tokens in (1, 37, 300, 5):
                x = torch.randn(tokens, 3, 64, generator=torch.Generator().manual_seed(tokens))
                x[0, 1] = 0.0
                stored, scale = encode_hidden(x * 20, dtype)
                for compute in (torch.float32, torch.bfloat16):
                    want = decode_scaled_hidden(stored, scale, 64, compute)
                    got = decode_scaled_hidden(stored, scale, 64, compute, compiled=True)
                    assert got.shape == (tokens, 3, 64) and got.dtype == compute
                    assert torch.equal(got, want), (dtype, tokens, compute)
        # (nvfp4, fp8) x (fp32, bf16)
        assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
