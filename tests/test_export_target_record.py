"""An export records the target its training store came from (`dflash_offline_target` in its
config.json: the model as given and a local folder's weights sha256), and `dflash evaluate` /
`evaluate-offline` say when they measure it on another target of the same shapes (a base
model beside its instruct twin fits every shape check and drafts for the wrong one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny_runs import tiny_store_and_run

from common.logging import get_logger
from common.store import open_store
from evaluation.offline import OfflineEvalConfig, run_offline_eval
from evaluation.online import EvaluateConfig, run_evaluate
from stage1_extract.fingerprints import weights_fingerprint
from stage2_train.export import TRAINED_FOR_KEY, export_checkpoint, other_target, trained_for


def test_other_target_tells_only_what_it_can_know() -> None:
    record = {TRAINED_FOR_KEY: {"name_or_path": "/m/base", "weights_sha256": "a" * 64}}
    assert other_target(record, "/m/base-copy", "a" * 64) == ""  # same weights, moved
    assert "trained for /m/base (weights sha256 aaaaaaaaaaaa), not /m/inst (bbbbbbbbbbbb)" in (
        other_target(record, "/m/inst", "b" * 64)
    )
    assert other_target(record, "Org/Model", None) == ""  # a hub id beside a folder: unknown
    hub = {TRAINED_FOR_KEY: {"name_or_path": "Org/Model", "weights_sha256": None}}
    assert other_target(hub, "org/model", None) == ""
    assert other_target(hub, "Org/Model-Instruct", None) == (
        "trained for Org/Model, not Org/Model-Instruct"
    )
    assert other_target({}, "/m/inst", "b" * 64) == ""  # an export from before the record


@pytest.fixture(scope="module")
def run(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_store_and_run(tiny_qwen3, tmp_path_factory.mktemp("trained-for"), steps=2)


def _warnings(caplog: pytest.LogCaptureFixture, call) -> str:
    log = get_logger()  # (it may not propagate to the root logger caplog reads)
    log.addHandler(caplog.handler)
    try:
        caplog.clear()
        call()
    finally:
        log.removeHandler(caplog.handler)
    return caplog.text


def test_exports_record_the_target_and_evaluate_names_another(
    run: tuple[Path, Path], tiny_qwen3: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, folder = run
    config = json.loads((folder / "export" / "config.json").read_text())
    recorded = config[TRAINED_FOR_KEY]
    assert recorded == trained_for(open_store(store).attrs)
    assert recorded == {
        "name_or_path": str(tiny_qwen3),
        "weights_sha256": weights_fingerprint(str(tiny_qwen3)),
    }
    again = export_checkpoint(str(folder), out=str(tmp_path / "again"))  # `dflash export RUN`
    assert json.loads((again / "config.json").read_text())[TRAINED_FOR_KEY] == recorded

    # the same shapes, other weights: a copy of the target with one tensor changed
    twin = tmp_path / "twin"
    shutil.copytree(tiny_qwen3, twin)
    weights = next(twin.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")

    def evaluate(target: Path) -> str:
        cfg = EvaluateConfig(str(target), str(data), drafter=str(again), new_tokens=8)
        return _warnings(caplog, lambda: run_evaluate(cfg))

    assert "another target" not in evaluate(tiny_qwen3)
    assert f"was trained for {tiny_qwen3}" in evaluate(twin)

    offline = OfflineEvalConfig(store=str(store), drafter=str(again), max_sequences=2)
    assert "another target" not in _warnings(caplog, lambda: run_offline_eval(offline))
    config[TRAINED_FOR_KEY]["weights_sha256"] = "f" * 64
    (again / "config.json").write_text(json.dumps(config))
    assert "its figures are another target's" in _warnings(
        caplog, lambda: run_offline_eval(offline)
    )
