"""`data.hidden_as_fp8` / `data.hidden_as_fp4`: training on a bf16 store as an fp8 store (or a
store of 4-bit features) would feed it.

The point of the option is a like-for-like measurement (one bf16 store, the same text and
held-out sequences, only the features' rounding differs), so the test holds it to exactly that:
with a target that computes in bf16, extract's fp8 store and the bf16 store rounded in the
loader give the drafter the same bits, and training on them gives the same losses and
held-out figures to the last digit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import zarr

from common.config import build_config
from common.fp4 import dequantize_nvfp4, round_features_fp4
from common.store import bf16_to_bits, bits_to_bf16
from common.store_files import record_shard_files
from common.tiny import EXAMPLE_DATA
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
COMPARED = ("loss", "acc", "eval_loss", "eval_tau", "eval_acc")


@pytest.fixture(scope="module")
def stores(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("as-fp8")
    data = work / "data.jsonl"
    data.write_text("\n".join(EXAMPLE_DATA.read_text().splitlines()[:16]) + "\n")
    out = {}
    for dtype in ("bfloat16", "float8_e4m3fn", "nvfp4"):
        out[dtype] = work / dtype
        sets = [
            f"target.model={tiny_qwen3}",
            "target.dtype=bfloat16",  # extract quantizes the bf16 activations the bf16 store keeps
            f"data.path={data}",
            f"store.out={out[dtype]}",
            f"store.hidden_dtype={dtype}",
            "packing.seq_len=64",
            "store.sequences_per_shard=4",
            "store.chunk_tokens=32",
            "run.progress=false",
        ]
        run_extract(build_config(ExtractConfig, DEBUG, "extract", sets))
    return out


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", "run.progress=false", "optim.max_steps=4"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, "run.eval_every=2", *sets]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in COMPARED if k in r} for r in rows]


def test_a_bf16_store_rounded_trains_as_the_fp8_store(
    stores: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    fp8 = train(stores["float8_e4m3fn"], tmp_path / "fp8")
    assert "rounded to fp8" not in caplog.text
    rounded = train(stores["bfloat16"], tmp_path / "rounded", "data.hidden_as_fp8=true")
    # the run's log says its figures are an fp8 store's (a device log is all a reader has)
    assert "features rounded to fp8 (data.hidden_as_fp8)" in caplog.text
    plain = train(stores["bfloat16"], tmp_path / "plain")
    assert len(fp8) == 4 and sum("eval_tau" in r for r in fp8) == 2
    assert rounded == fp8
    assert plain != fp8  # the rounding is visible: the comparison above could fail
    # on an fp8 store the option changes nothing
    assert train(stores["float8_e4m3fn"], tmp_path / "fp8-again", "data.hidden_as_fp8=true") == fp8


def test_nvfp4_rounding_trains_as_the_nvfp4_store(
    stores: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """`data.hidden_as_fp4=nvfp4` on the bf16 store trains, and evaluates held-out, exactly as
    extract's nvfp4 store of the same text (store.hidden_dtype=nvfp4), whose bytes are the bf16
    store's features encoded."""
    nvfp4 = train(stores["nvfp4"], tmp_path / "nvfp4")
    rounded = train(stores["bfloat16"], tmp_path / "rounded", "data.hidden_as_fp4=nvfp4")
    assert "features rounded to nvfp4 (data.hidden_as_fp4)" in caplog.text
    assert len(nvfp4) == 4 and sum("eval_tau" in r for r in nvfp4) == 2
    assert rounded == nvfp4
    assert nvfp4 != train(stores["bfloat16"], tmp_path / "plain")  # the rounding is visible
    for folder in sorted((stores["nvfp4"] / "shards").iterdir()):
        group = zarr.open_group(folder, mode="r")
        rows, scale = (
            torch.from_numpy(group["hidden"][...]),
            torch.from_numpy(group["hidden_scale"][...]),
        )
        bf16_group = zarr.open_group(stores["bfloat16"] / "shards" / folder.name, mode="r")
        want = round_features_fp4(bits_to_bf16(bf16_group["hidden"][...]), "nvfp4")
        assert torch.equal(dequantize_nvfp4(rows, scale), want)


@pytest.mark.parametrize("kind", ["mxfp4"])
def test_fp4_rounding_trains_as_a_store_of_the_rounded_features(
    stores: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
):
    """`data.hidden_as_fp4=mxfp4` (no store holds it): the bf16 store rounded in the loader
    trains, and evaluates held-out, exactly as a copy of that store whose features were
    rounded on disk (mxfp4's values are exact in bf16)."""
    rounded_store = tmp_path / "rounded-store"
    shutil.copytree(stores["bfloat16"], rounded_store)
    for folder in sorted((rounded_store / "shards").iterdir()):
        group = zarr.open_group(folder, mode="r+")
        features = bits_to_bf16(group["hidden"][...])
        group["hidden"][...] = bf16_to_bits(round_features_fp4(features, kind).to(torch.bfloat16))
        record_shard_files(folder)  # the sizes a v2 store records, as extract does
    on_disk = train(rounded_store, tmp_path / "on-disk")
    in_loader = train(stores["bfloat16"], tmp_path / "in-loader", f"data.hidden_as_fp4={kind}")
    assert f"features rounded to {kind} (data.hidden_as_fp4)" in caplog.text
    assert in_loader == on_disk
    assert in_loader != train(stores["bfloat16"], tmp_path / "plain")  # the rounding is visible
