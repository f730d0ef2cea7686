"""`dflash train` checks every shard's array metadata before the model is built: a foreign or
damaged shard (an array of another dtype or shape than the root attributes give it, a missing
array, an unreadable zarr.json, another sequence count) stops the run at its start with one
error naming every bad shard, not at the shard's first read hours in. JSON only, no array data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from store_factory import FactorySpec
from store_factory import build_store as build_factory_store
from test_store_integrity import LAYOUT_DAMAGE, rewrite_array, shard, train_cfg
from zarr import open_array

from common import store_check
from common.store import StoreError, StoreInfo, open_store
from common.store_check import check_shards
from common.store_files import record_shard_files
from stage2_train import train
from stage2_train.data import loader_arrays


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six shards of four sequences."""
    out = tmp_path_factory.mktemp("shard-meta") / "store"
    return build_factory_store(out, FactorySpec(num_sequences=24, sequences_per_shard=4))


@pytest.fixture
def store(clean: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clean, tmp_path / "store"))


def check(store: Path, distill: bool = True) -> None:
    info = open_store(store)  # every damage below keeps the recorded sizes right
    check_shards(info, loader_arrays(info.hidden_dtype, distill))


def test_train_refuses_every_bad_shard_before_the_model_is_built(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden = open_array(shard(store, 3) / "hidden", mode="r")[:]
    rewrite_array(shard(store, 3), "hidden", hidden.view("uint8"))  # bf16 bits read as fp8's
    shutil.rmtree(shard(store, 1) / "tokens")
    (shard(store, 4) / "loss_mask" / "zarr.json").write_text("{")
    for index in (1, 4):
        record_shard_files(shard(store, index))

    def launched(*args: object) -> None:
        raise AssertionError("the workers were started")

    monkeypatch.setattr(train, "launch", launched)
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
