"""The gaps a review of tests/test_review_bad_input.py left: each `error:` line names the input
as the user typed it (a flag or config key) and the fix: a --set data.dev_store that is no
store, a damaged one or one of another target (refused with train's other input checks, before
the model is built), a shard folder (or the shards folder) given for the store, a --config that
is no YAML, a --data hub name that cannot be reached.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from store_factory import FactorySpec, build_store

from common.store import ROOT_ATTR, open_store
from dflash_offline.cli import main as cli
from stage2_train import train
from stage2_train.inputs import open_dev_store

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
DEV_FIX = (
    ": pass a store of your dev prompts, written by `dflash generate --data DEV.jsonl --out "
    "GEN` then `dflash extract --data GEN --out STORE --set store.hidden_dtype=bfloat16` with "
    "the training target (README's "
    "evaluate-offline recipe), or leave data.dev_store unset"
)


def error_line(result: Any) -> str:
    """The output's one `error:` line (no traceback)."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("s") / "store", FactorySpec(num_sequences=4))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dev store is checked with the other inputs: before the workers build the model."""

    def launched(*args: object) -> None:
        raise AssertionError("the workers started before data.dev_store was checked")

    monkeypatch.setattr(train, "launch", launched)


def _train(store: Path, dev: Path, out: Path) -> Any:
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(out)]
    return CliRunner().invoke(cli, [*args, "--devices", "cpu", "--set", f"data.dev_store={dev}"])


@pytest.mark.parametrize("kind", ["missing", "empty folder", "shard", "damaged"])
def test_train_dev_store_that_is_no_store_names_the_key(
    tmp_path: Path, store: Path, kind: str, no_launch: None
) -> None:
    # before: `store X does not exist; run dflash extract to create it`, or `X is not a dflash
    # store`: the path alone, not that it came from data.dev_store, nor what a dev store is;
    # then named, but only once the workers had built the model (minutes on a real target)
    empty = tmp_path / "empty"  # a folder of its own: the run (tmp_path / "r") is not in it
    empty.mkdir()
    dev = {"missing": tmp_path / "dev", "empty folder": empty, "shard": None}.get(kind)
    dev = dev or store / "shards" / "shard-000000"
    if kind == "damaged":  # a cut file reads as zeros: found before reading, from its record
        dev = Path(shutil.copytree(store, tmp_path / "dev"))
        chunks = dev / "shards" / "shard-000000" / "tokens" / "c"
        min(p for p in chunks.rglob("*") if p.is_file()).unlink()
    result = _train(store, dev, tmp_path / "r")
    assert result.exit_code == 2, result.output
    expected = {
        "missing": f"error: data.dev_store {dev} does not exist{DEV_FIX}",
        "empty folder": f"error: data.dev_store {dev} is not a dflash store (no zarr.json){DEV_FIX}",
        "shard": f"error: data.dev_store: {dev} is one shard of a store, not a store: pass the "
        f"store folder {store} (two levels up)",
        "damaged": f"error: data.dev_store: store {dev}: 1 of 1 shards do not hold what its root "
        "attributes and their own file records promise (found before reading, from their "
        "metadata and file sizes):",
    }[kind]
    assert error_line(result) == expected
    assert not (tmp_path / "r").exists()


def _with_root(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of store `src` at `dst`, its root attributes changed by `edit`."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "zarr.json").read_text())
    edit(doc["attributes"][ROOT_ATTR])
    (dst / "zarr.json").write_text(json.dumps(doc))
    return dst


def _target(name: str, digest: str | None) -> Callable[[dict], None]:
    def edit(attrs: dict) -> None:
        attrs["target"]["name_or_path"] = name
        attrs["fingerprints"] = {"target_weights_sha256": digest}

    return edit


MISMATCHES = {  # (the dev store's, the training store's root edits): what is named
    "layers": (lambda a: a.update(tapped_layers=[0, 3]), None, "tapped_layers [0, 3] vs [0, 2]"),
    # same shapes, other weights: a base target beside its instruct twin
    "weights": (_target("m", "aa"), _target("m", "bb"), "target m vs m (weights differ)"),
    "hub id": (
        _target("Org/Chat", None),
        _target("org/base", None),
        "target Org/Chat vs org/base (hub ids differ)",
    ),
    "tokenizer": (
        lambda a: a["tokenizer"].update(vocab_size=50),
        None,
        "tokenizer of 50 vs 48 tokens",
    ),
}


@pytest.mark.parametrize("kind", MISMATCHES)
def test_train_dev_store_of_another_target_is_refused_with_the_inputs(
    tmp_path: Path, store: Path, kind: str, no_launch: None
) -> None:
    # before: layers, sizes or vocabulary named once the workers had built the model; other
    # weights of the same shapes, or another tokenizer of the model's vocabulary, not at all
    edit_dev, edit_train, named = MISMATCHES[kind]
    dev = _with_root(store, tmp_path / "dev", edit_dev)
    train_store = _with_root(store, tmp_path / "store", edit_train) if edit_train else store
    result = _train(train_store, dev, tmp_path / "r")
    assert result.exit_code == 2, result.output
    target = open_store(train_store).attrs["target"]["name_or_path"]
    assert error_line(result) == (
        f"error: data.dev_store {dev} does not match the training store {train_store} "
        f"({named}): extract it with the same target, tokenizer and target.tapped_layers as the "
        f"training store (target {target}, tokenizer factory), or leave data.dev_store unset"
    )


def test_a_dev_store_of_the_same_target_by_other_names_is_taken(
    tmp_path: Path, store: Path
) -> None:
    # a hub id's case, a digest beside a hub id (a folder may hold its download), a store from
    # before fingerprints: nothing tells these targets apart
    train_info = open_store(_with_root(store, tmp_path / "t", _target("Org/M", None)))
    for name, edit in (
        ("case", _target("org/m", None)),
        ("digest", _target("/models/m", "aa")),
        ("unrecorded", lambda a: None),
    ):
        dev = _with_root(store, tmp_path / name, edit)
        assert open_dev_store(str(dev), train_info, train_info.tapped_layers).path == dev


def test_inspect_of_a_shard_says_to_pass_its_store(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: `X is a Zarr store but not a dflash store (no 'dflash' attributes)`, no fix
    shard = store / "shards" / "shard-000000"
    result = CliRunner().invoke(cli, ["inspect", str(shard)])
    assert result.exit_code == 2
    assert error_line(result) == (
        f"error: {shard} is one shard of a store, not a store: pass the store folder {store} "
        "(two levels up)"
    )
    result = CliRunner().invoke(cli, ["inspect", str(store / "shards")])
    assert error_line(result) == (
        f"error: {store / 'shards'} is the shards folder of a store, not a store: pass the "
        f"store folder {store} (one level up)"
    )
    # relative, from inside the shards folder: the store is `..`
    monkeypatch.chdir(store / "shards")
    result = CliRunner().invoke(cli, ["inspect", "shard-000000"])
    assert "pass the store folder .. (two levels up)" in error_line(result)


def test_inspect_of_another_zarr_store_is_unchanged(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    result = CliRunner().invoke(cli, ["inspect", str(other)])
    assert error_line(result) == (
        f"error: {other} is a Zarr store but not a dflash store (no 'dflash' attributes)"
    )


@pytest.mark.parametrize("command", ["generate", "extract", "train"])
def test_config_that_is_not_yaml_names_the_file_line_and_fix(tmp_path: Path, command: str) -> None:
    # before: the parser's message about "<unicode string>" and no fix
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"{command}:\n  data:\n    store: x\n   bad: [\n")
    result = CliRunner().invoke(cli, [command, "--config", str(bad)])
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith(f"error: config file {bad} is not valid YAML: "), line
    assert f'in "{bad}", line 4, column 4' in line and "<unicode string>" not in line
    assert line.endswith(
        f"; fix the YAML near the lines named (`dflash {command} --help-config` lists the keys)"
    )


@pytest.mark.parametrize("command", ["extract", "generate"])
def test_unreachable_hub_dataset_gives_the_fix(
    tiny_qwen3: Path, tmp_path: Path, command: str
) -> None:
    # offline (conftest: HF_DATASETS_OFFLINE=1). Before: the reason alone, no fix
    args = [command, "--config", str(DEBUG), "--model", str(tiny_qwen3)]
    args += ["--data", "no-such-org/no-such-dataset"]
    result = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "o"), "--devices", "cpu"])
    assert result.exit_code == 2
    line = error_line(result)
    assert line.startswith(
        "error: data 'no-such-org/no-such-dataset' is neither a local file/folder nor a "
        "reachable hub dataset (name=None, split='train'): "
    ), line
    assert line.endswith(
        "; pass a local .jsonl.gz/.json.gz/.jsonl/.json/.parquet file or folder of them with "
        "--data, or check the hub name, data.name and data.split, the network and "
        "HF_DATASETS_OFFLINE"
    ), line
