"""A new user's likely mistakes, each one `error:` line (or a Click usage error) naming the
input and the fix, before anything heavy loads: a --model that is no model (generate), the
generate output or the store itself given to train, a --device the machine lacks and a drafter
of another target (evaluate), a malformed or folder --data (evaluate reads what extract reads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from store_factory import FactorySpec, build_store
from transformers import AutoModelForCausalLM

from common.generated import META_DIR
from dflash_offline.cli import main as cli
from stage2_train.config import DrafterConfig
from stage2_train.export import export_drafter
from stage2_train.model import DFlashDrafter, drafter_shape

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


def error_line(result: Any) -> str:
    """The output's one `error:` line (no traceback)."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def _no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("loaded the target's weights past the point of refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def _export(target: Path, folder: Path) -> Path:
    config = json.loads((target / "config.json").read_text())
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=4), config, 2, config["vocab_size"], 3
    )
    return export_drafter(DFlashDrafter(shape), shape, [0, 2], config, folder)


def _evaluate(target: Path, data: Path, *args: str) -> Any:
    argv = ["evaluate", "--target", str(target), "--data", str(data), "--num-prompts", "1"]
    return CliRunner().invoke(cli, [*argv, "--new-tokens", "4", *args])


@pytest.mark.parametrize("kind", ["missing", "dataset folder"])
@pytest.mark.parametrize("given", ["--model", "target.model"])
def test_generate_names_a_model_that_is_not_one(tmp_path: Path, kind: str, given: str) -> None:
    # generate loads the tokenizer first: its failure blamed the tokenizer and offered
    # --set target.tokenizer, not the wrong --model; then it named `target.model` (extract's
    # config key) where the user typed --model
    model = tmp_path / "nope"
    if kind == "dataset folder":
        model.mkdir()
        (model / "part-000000.jsonl").write_text('{"text": "hi"}\n')
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    target = ["--model", str(model)] if given == "--model" else ["--set", f"target.model={model}"]
    args = ["generate", *target, "--data", str(data), "--out", str(tmp_path / "g")]
    result = CliRunner().invoke(cli, [*args, "--devices", "cpu"])
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith(f"error: {given} {model}: "), line
    assert ("no such folder" if kind == "missing" else "folder has no config.json") in line
    assert "tokenizer" not in line


def test_generate_names_the_model_as_given_past_the_tokenizer(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    # the tokenizer from target.tokenizer loads: the model is first read for its positions
    model = tmp_path / "tokenizer-only"
    model.mkdir()
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["generate", "--data", str(data), "--out", str(tmp_path / "g"), "--devices", "cpu"]
    args += ["--set", f"target.tokenizer={tiny_qwen3}"]
    config = tmp_path / "c.yaml"
    config.write_text(f"generate:\n  target:\n    model: {model}\n")
    for target, given in ((["--model", str(model)], "--model"), (["--config", str(config)], "")):
        result = CliRunner().invoke(cli, [*args, *target])
        assert result.exit_code == 2
        assert error_line(result).startswith(
            f"error: {given or 'target.model'} {model}: folder has no config.json"
        ), result.output


def test_extract_and_convert_name_the_target_as_given(tmp_path: Path) -> None:
    model = tmp_path / "nope"
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["extract", "--data", str(data), "--out", str(tmp_path / "s"), "--devices", "cpu"]
    for target, given in (
        (["--model", str(model)], "--model"),
        (["--set", f"target.model={model}"], "target.model"),
    ):
        result = CliRunner().invoke(cli, [*args, *target])
        assert result.exit_code == 2
        assert error_line(result).startswith(f"error: {given} {model}: no such folder"), result
    h5 = tmp_path / "in.h5"
    with h5py.File(h5, "w") as f:  # the least input convert reads before the target
        f["tokens"], f["doc_lengths"] = np.arange(4), [4]
        f["hidden"] = np.zeros((4, 1, 8), np.float32)
        f["hidden"].attrs["tapped_layers"] = [0]
    result = CliRunner().invoke(
        cli, ["convert", str(h5), str(tmp_path / "s2"), "--target", str(model)]
    )
    assert result.exit_code == 2
    assert error_line(result).startswith(f"error: --target {model}: no such folder"), result.output


def test_a_hub_target_with_a_revision_offers_target_revision(tmp_path: Path) -> None:
    # offline (conftest): the revision set with --set may be the fault, whatever gave the name
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = ["generate", "--model", "no-such-org/no-such-model", "--data", str(data)]
    args += ["--out", str(tmp_path / "g"), "--devices", "cpu"]
    for extra, hint in (
        ([], "check the name, network"),
        (["--set", "target.revision=v2"], "check the name, target.revision, network"),
    ):
        result = CliRunner().invoke(cli, [*args, *extra])
        assert result.exit_code == 2
        assert error_line(result).startswith("error: --model no-such-org/no-such-model: cannot")
        assert hint in " ".join(result.output.split()), result.output


def test_train_on_a_generate_output_says_to_extract_it_first(tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    (gen / META_DIR).mkdir(parents=True)
    args = ["train", "--config", str(DEBUG), "--store", str(gen), "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(cli, [*args, "--devices", "cpu"])
    assert result.exit_code == 2
    assert error_line(result) == (
        f"error: {gen} is a `dflash generate` output, not a store: run `dflash extract "
        f"--data {gen} --out STORE` on it, then pass STORE"
    )


@pytest.mark.parametrize("inside", ["", "run"])
def test_train_out_inside_the_store_is_refused(tmp_path: Path, inside: str) -> None:
    # before, the run's checkpoints, metrics and export were written among the store's files
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=4))
    out = store / inside if inside else store
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--devices", "cpu"])
    assert result.exit_code == 2
    assert f"--out {out} is inside the store {store} (--store)" in error_line(result)
    assert not any(p.name.startswith("step-") for p in store.iterdir())
    assert not (store / "metrics.jsonl").exists()


def test_train_out_inside_the_dev_store_is_refused(tmp_path: Path) -> None:
    # data.dev_store is a store too: its folder was not checked
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=4))
    dev = build_store(tmp_path / "dev", FactorySpec(num_sequences=2))
    out = dev / "run"
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--devices", "cpu", "--set", f"data.dev_store={dev}"])
    assert result.exit_code == 2
    assert f"--out {out} is inside the store {dev} (data.dev_store)" in error_line(result)
    assert not out.exists()


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cuda:0", "cuda:0: this machine has no CUDA GPU; pass cpu"),
        ("gpu", "'gpu' is not a device"),
    ],
)
@pytest.mark.parametrize("command", ["evaluate", "evaluate-offline"])
def test_a_device_the_machine_lacks_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, expected: str, command: str
) -> None:
    # before: `error: AssertionError: Torch not compiled with CUDA enabled` (exit 1, "a bug")
    # once the weights had loaded, or torch's list of every device type it knows
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if command == "evaluate":
        args = ["evaluate", "--target", "t", "--data", "d"]
    else:
        args = ["evaluate-offline", "--drafter", "d", "--store", "s"]
    result = CliRunner().invoke(cli, [*args, "--device", device])
    assert result.exit_code == 2
    assert "Invalid value for '--device'" in result.output and expected in result.output


@pytest.mark.parametrize(
    ("change", "expected"),
    [({"hidden_size": 96}, "hidden size 64 vs 96"), ({"vocab_size": 300}, "vocab 512 vs 300")],
)
def test_a_drafter_of_another_target_is_refused_before_the_weights_load(
    tiny_qwen3: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: dict,
    expected: str,
) -> None:
    # before: a RuntimeError of matmul shapes at the first draft, after all of prompt lookup
    # (another width), or figures measured through another vocabulary without a word
    drafter = _export(tiny_qwen3, tmp_path / "export")
    other = Path(shutil.copytree(tiny_qwen3, tmp_path / "other"))
    config = other / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    _no_weights(monkeypatch)
    result = _evaluate(other, tmp_path / "d.jsonl", "--drafter", str(drafter))
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith(f"error: --drafter {drafter} was not trained for --target {other}: ")
    assert expected in line and "pass the target whose store trained the drafter" in line


def test_evaluate_names_a_target_that_is_not_one(tmp_path: Path) -> None:
    # before: `error: OSError: Repo id must be in the form 'repo_name' ...` (exit 1, "a bug");
    # then extract's `target.model X`, a key evaluate has not: the user typed --target
    result = _evaluate(tmp_path / "nope", tmp_path / "d.jsonl")
    assert result.exit_code == 2
    assert error_line(result) == (
        f"error: --target {tmp_path / 'nope'}: no such folder; pass an existing model folder "
        "(config.json + weights) or a hub id like Qwen/Qwen3-8B"
    )
    # a hub id offline: the fix offers no target.revision, which evaluate has no flag for
    result = _evaluate(Path("no-such-org/no-such-model"), tmp_path / "d.jsonl")
    assert result.exit_code == 2
    assert error_line(result).startswith(
        "error: --target no-such-org/no-such-model: cannot load its config"
    )
    # (transformers' reason spans lines)
    assert result.output.rstrip().endswith("(check the name, network/HF_HUB_OFFLINE)")


def test_evaluate_data_reads_as_extract_does(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a malformed line was `error: DatasetGenerationError: An error occurred while
    # generating the dataset` and a folder `FileNotFoundError: Unable to find` (exit 1 both)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello world"}\n{"text": "cut\n')
    _no_weights(monkeypatch)
    result = _evaluate(tiny_qwen3, bad)
    assert result.exit_code == 2
    assert f"data file {bad} line 2, column 14: " in error_line(result)
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "part-000000.jsonl").write_text('{"foo": 1}\n')
    result = _evaluate(tiny_qwen3, folder)
    assert result.exit_code == 2
    assert f"--data {folder}: no column 'text' or 'messages' (found ['foo']); pass " in (
        error_line(result)
    )
