"""The check of every shard before a store is read (common/store_check.py): a deleted or cut
file and a foreign or damaged array's metadata (another dtype or shape than the root attributes
give it, a missing array, an unreadable zarr.json, another sequence count), in different
shards, named in one error by `dflash train` before the model is built (its first-shard input
check included) and by `dflash convert`, so one round of deleting shard folders and rerunning
`dflash extract` repairs the store. JSON and stat only, no array data.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from store_factory import FactorySpec
from store_factory import build_store as build_factory_store
from test_store_integrity import LAYOUT_DAMAGE, rewrite_array, shard, train_cfg
from zarr import open_array

from common import store_check
from common.store import StoreError, StoreInfo, open_store
from common.store_check import check_shards
from common.store_files import record_shard_files
from dflash_offline.cli import main as cli
from stage2_train import train
from stage2_train.data import loader_arrays
from stage2_train.inputs import check_inputs


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six shards of four sequences."""
    out = tmp_path_factory.mktemp("store-check") / "store"
    return build_factory_store(out, FactorySpec(num_sequences=24, sequences_per_shard=4))


@pytest.fixture
def store(clean: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean, tmp_path / "store"))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training's workers must not start: the check comes before them."""

    def launched(*args: object) -> None:
        raise AssertionError("the workers were started")

    monkeypatch.setattr(train, "launch", launched)


def check(store: Path, distill: bool = True) -> None:
    info = open_store(store)  # every damage below keeps the recorded sizes right
    check_shards(info, loader_arrays(info.hidden_dtype, distill))


def chunk_file(store: Path, index: int, array: str) -> Path:
    return min(p for p in (shard(store, index) / array / "c").rglob("*") if p.is_file())


def foreign_hidden(store: Path, index: int) -> None:
    """Shard `index`'s bf16 hidden bits rewritten as uint8 (fp8's), its file record agreeing."""
    hidden = open_array(shard(store, index) / "hidden", mode="r")[:]
    rewrite_array(shard(store, index), "hidden", hidden.view("uint8"))


CUT = "  - shard-000002 array tokens: file tokens/c/"
FOREIGN = "  - shard-00000{} array hidden: dtype uint8, expected uint16"


def assert_one_report(message: str, store: Path, first: str, second: str) -> None:
    """The store's header, the two problems a line each, then the fix."""
    lines = message.splitlines()
    assert lines[0].startswith(f"store {store}: 2 of 6 shards do not hold what"), message
    assert lines[1].startswith(first) and lines[2].startswith(second), message
    assert len(lines) == 4 and "rerun the same `dflash extract` command" in lines[3], message


def test_train_names_cut_files_and_foreign_arrays_in_one_error(
    store: Path, tmp_path: Path, no_launch: None
) -> None:
    chunk_file(store, 2, "tokens").unlink()  # reads as zeros: only its record tells
    foreign_hidden(store, 4)  # its record agrees: only its metadata tells
    with pytest.raises(StoreError) as caught:
        train.run_train(train_cfg(store, tmp_path / "run"))
    assert_one_report(str(caught.value), store, CUT, FOREIGN.format(4))
    assert "is missing (it would read as zeros)" in str(caught.value)


def test_a_foreign_first_shard_is_in_the_same_report(store: Path, tmp_path: Path) -> None:
    """check_inputs reads shard 0's hidden metadata first: a foreign one there was its own
    'drafter config does not fit' error, and the other shard's damage came a round later."""
    foreign_hidden(store, 0)
    os.truncate(chunk_file(store, 2, "tokens"), 3)
    cfg = train_cfg(store, tmp_path / "run")
    with pytest.raises(StoreError) as caught:
        check_inputs(cfg)
    assert_one_report(str(caught.value), store, FOREIGN.format(0), CUT)
    assert "is 3 bytes" in str(caught.value)
    with pytest.raises(StoreError) as again:
        train.run_train(cfg)
    assert str(again.value) == str(caught.value)


def convert(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["convert", *map(str, args)])
    return result.exit_code, result.output


def test_convert_names_both_kinds_in_one_error(store: Path, tmp_path: Path) -> None:
    chunk_file(store, 2, "tokens").unlink()
    foreign_hidden(store, 4)
    out = tmp_path / "out.h5"
    code, text = convert(store, out)
    assert code == 2 and text.startswith("error: ") and not out.exists(), text
    assert_one_report(text.removeprefix("error: ").strip(), store, CUT, FOREIGN.format(4))
    # only the arrays written are required, and only the shards selected
    code, text = convert(store, out, "--arrays", "tokens", "--shards", "3-5")
    assert code == 0 and out.exists(), text


def test_convert_of_an_unfinished_store_checks_its_committed_shards(tmp_path: Path) -> None:
    """No counts yet: every shard but the plan's last holds sequences_per_shard, and the last
    (committed early, e.g. by another writer) is checked against its own count."""
    spec = FactorySpec(num_sequences=10, sequences_per_shard=4)  # the last shard holds 2
    store = build_factory_store(tmp_path / "store", spec)
    doc = json.loads((store / "zarr.json").read_text())
    del doc["attributes"]["dflash"]["counts"]
    doc["attributes"]["dflash"]["complete"] = False
    (store / "zarr.json").write_text(json.dumps(doc))
    code, text = convert(store, tmp_path / "out.h5")
    assert code == 0, text
    foreign_hidden(store, 1)
    code, text = convert(store, tmp_path / "out2.h5")
    assert code == 2 and "1 of 3 shards" in text and FOREIGN.format(1) in text, text


def test_train_refuses_every_bad_shard_before_the_model_is_built(
    store: Path, tmp_path: Path, no_launch: None
) -> None:
    foreign_hidden(store, 3)
    shutil.rmtree(shard(store, 1) / "tokens")
    (shard(store, 4) / "loss_mask" / "zarr.json").write_text("{")
    for index in (1, 4):
        record_shard_files(shard(store, index))
    with pytest.raises(StoreError) as caught:
        train.run_train(train_cfg(store, tmp_path / "run"))
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"store {store}: 3 of 6 shards do not hold what")
    assert lines[1] == "  - shard-000001 array tokens: missing (no tokens/zarr.json)"
    assert lines[2] == "  - shard-000003 array hidden: dtype uint8, expected uint16"
    assert lines[3].startswith("  - shard-000004 array loss_mask: loss_mask/zarr.json unreadable")
    assert len(lines) == 5 and f"under {store / 'shards'}" in lines[4]
    assert "rerun the same `dflash extract` command" in lines[4]
    assert f"`dflash inspect verify {store}`" in lines[4]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("case", LAYOUT_DAMAGE)
def test_the_check_at_start_names_what_the_first_read_would(tmp_path: Path, case: str) -> None:
    name, change, what = LAYOUT_DAMAGE[case]  # test_store_integrity's lazy-check cases
    store = build_factory_store(tmp_path / "store")
    folder = shard(store, 1)
    rewrite_array(folder, name, change(open_array(folder / name, mode="r")[:]))
    with pytest.raises(StoreError, match="1 of 3 shards") as caught:
        check(store)
    assert f"\n  - shard-000001 array {name}: {what}\n" in str(caught.value)


def test_a_shard_of_another_sequence_count_is_refused(store: Path) -> None:
    """A shard copied from elsewhere: its own record and shapes agree, so the first read would
    take its rows as the plan's without a word."""
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["dflash"]["counts"]["sequences"] = 22  # the last shard holds 2
    (store / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(StoreError) as caught:
        check(store)
    assert "\n  - shard-000005: 4 sequences, expected 2\n" in str(caught.value)


def test_only_the_arrays_training_reads_are_required(store: Path) -> None:
    shutil.rmtree(shard(store, 2) / "topk_logits")
    shutil.rmtree(shard(store, 2) / "doc_piece")
    record_shard_files(shard(store, 2))
    check(store, distill=False)  # top-k arrays are read only to distil; doc_* never
    with pytest.raises(StoreError, match="shard-000002 array topk_logits: missing"):
        check(store, distill=True)


def test_fp8_hidden_scale_is_checked(tmp_path: Path) -> None:
    store = build_factory_store(tmp_path / "store", FactorySpec(hidden_dtype="float8_e4m3fn"))
    check(store)
    shutil.rmtree(shard(store, 0) / "hidden_scale")
    record_shard_files(shard(store, 0))
    with pytest.raises(StoreError, match="shard-000000 array hidden_scale: missing"):
        check(store)


def test_past_the_detailed_lines_every_bad_shard_is_still_named(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = open_store(store)
    other = StoreInfo(info.path, {**info.attrs, "topk": info.topk + 1})  # every shard disagrees
    monkeypatch.setattr(store_check, "MAX_DETAILED", 3)
    with pytest.raises(StoreError) as caught:
        check_shards(other, loader_arrays(info.hidden_dtype, True))
    lines = str(caught.value).splitlines()
    assert "6 of 6 shards" in lines[0] and len(lines) == 6
    assert lines[1] == "  - shard-000000 array topk_ids: shape (4, 64, 4), expected (4, 64, 5)"
    assert lines[4] == "  - and 9 more problems, in shard-000001 to shard-000005"
