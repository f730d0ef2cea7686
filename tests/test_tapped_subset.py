"""`data.tapped_layers`: training on some of a store's tapped layers (what fewer layers cost,
measured from one store). The loader's items must be the full items with the other layers'
features cut out (checked against a plain index of the full read, for bf16 and fp8 stores),
a layer the store does not hold is refused before anything is built, and the drafter, its export
and its offline evaluation read exactly the chosen layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, build_store
from test_train_data import _dataset

from common.config import build_config
from common.store import open_store
from evaluation.offline import OfflineEvalConfig, run_offline_eval
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences, collate
from stage2_train.export import export_checkpoint
from stage2_train.inputs import check_inputs, open_dev_store
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
STORED = [0, 2, 5]


@pytest.fixture(scope="module", params=["bfloat16", "float8_e4m3fn"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = FactorySpec(num_sequences=8, tapped_layers=STORED, hidden_dtype=request.param)
    return build_store(tmp_path_factory.mktemp("subset") / request.param, spec)


def dev_store(folder: Path, layers: list[int]) -> Path:
    """A dev store of the same target, of other text, holding `layers`."""
    return build_store(folder, FactorySpec(num_sequences=3, tapped_layers=layers, seed=1))


def sequences(store: Path, layers: list[int] | None) -> StoreSequences:
    """test_train_data's dataset (top-k blocks too) reading `layers` of the store."""
    return _dataset(store, distill=True, layers=layers)


@pytest.mark.parametrize("layers", [[2, 5], [5, 0], [2]])
def test_items_hold_the_chosen_layers_only(store: Path, layers: list[int]) -> None:
    picked = [STORED.index(layer) for layer in layers]  # written out, not layer_index's
    keys = [(index, 0, False) for index in range(5)]
    full, chosen = sequences(store, None), sequences(store, layers)
    a, b = collate(full.__getitems__(keys)), collate(chosen.__getitems__(keys))
    assert b.hidden_TKD.shape[1] == len(layers)
    assert torch.equal(b.hidden_TKD, a.hidden_TKD[:, picked])
    if a.hidden_scale_TK is None:
        assert b.hidden_scale_TK is None
    else:
        assert torch.equal(b.hidden_scale_TK, a.hidden_scale_TK[:, picked])
    for name in ("tokens_T", "anchors_A", "labels_AB", "weights_AB", "topk_ids_ABk"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    row_full, row = full.read_row(3), chosen.read_row(3)
    assert torch.equal(row["hidden"], row_full["hidden"][:, picked])
    if "hidden_scale" in row_full:
        assert torch.equal(row["hidden_scale"], row_full["hidden_scale"][:, picked])


def test_all_layers_in_store_order_select_nothing(store: Path) -> None:
    assert sequences(store, list(STORED)).layer_index is None
    assert sequences(store, [5, 2, 0]).layer_index == [2, 1, 0]


@pytest.mark.parametrize("layers", [[1], [2, 2], []])
def test_a_layer_the_store_lacks_is_refused(store: Path, layers: list[int]) -> None:
    with pytest.raises(ValueError, match=r"data.tapped_layers .* holds layers \[0, 2, 5\]"):
        sequences(store, layers)
    sets = [f"data.store={store}", "run.out=/nonexistent", f"data.tapped_layers={layers}"]
    with pytest.raises(ValueError, match="tapped_layers"):  # the config's check or the store's
        check_inputs(build_config(TrainConfig, DEBUG, "train", sets))


def test_a_drafter_of_two_layers_trains_exports_and_evaluates(store: Path, tmp_path: Path):
    out = tmp_path / "run"
    sets = [
        f"data.store={store}",
        f"run.out={out}",
        "run.progress=false",
        "optim.max_steps=3",
        "run.eval_every=3",
        "data.holdout_sequences=2",
        "data.tapped_layers=[0,5]",
        # a dev store of other layers besides the two read: chained tau reads those two
        f"data.dev_store={dev_store(tmp_path / 'dev', [0, 1, 5])}",
    ]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 5]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval_tau" in last and last["dev_chained_tau"] >= 1.0
    # `dflash export RUN` reads the layers from the checkpoint's meta (the store may be gone)
    again = export_checkpoint(out, out=tmp_path / "again")
    config = json.loads((again / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 5]
    # the export reads its two layers out of the three-layer store, as `dflash evaluate --store`
    offline = run_offline_eval(OfflineEvalConfig(str(out / "export"), str(store)))
    assert offline["chained_responses"] > 0


def test_a_resume_cannot_change_the_layers(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    sets = [f"data.store={store}", f"run.out={out}", "run.progress=false", "run.eval_every=0"]
    sets += ["data.holdout_sequences=2", "optim.max_steps=4", "run.checkpoint_every=2"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*sets, "data.tapped_layers=[0,5]"]))
    again = [*sets, "optim.max_steps=6", "run.allow_config_change=true"]
    with pytest.raises(ValueError, match=r"data.tapped_layers: \[0, 5\] -> None"):
        run_train(build_config(TrainConfig, DEBUG, "train", again))


def test_a_dev_store_needs_the_layers_read_not_the_training_stores(
    store: Path, tmp_path: Path
) -> None:
    """data.dev_store holds the layers the drafter reads (more is fine, as for `dflash
    evaluate-offline`); one that lacks one is refused, naming what it holds and what is read."""
    info, dev = open_store(store), dev_store(tmp_path / "dev", [0, 5])
    assert open_dev_store(str(dev), info, [0, 5]).path == dev
    assert open_dev_store(str(store), info, [5]).path == store  # all of the training store's
    with pytest.raises(ValueError, match=r"tapped_layers \[0, 5\] vs \[0, 2, 5\]\): extract"):
        open_dev_store(str(dev), info, STORED)
    named = r"tapped_layers \[0, 5\] vs \[2, 5\] read \(data.tapped_layers\)"
    with pytest.raises(ValueError, match=named):
        open_dev_store(str(dev), info, [2, 5])


def test_layers_out_of_order_are_refused_and_an_unordered_store_is_read_ascending(tmp_path: Path):
    # servers (vLLM, SGLang) concatenate the layers in forward order: an export's
    # target_layer_ids in another order would get its features permuted there
    from stage1_extract.config import TargetConfig

    assert any("ascending" in p for p in TargetConfig(model="m", tapped_layers=[8, 1]).problems())
    assert not TargetConfig(model="m", tapped_layers=[1, 8]).problems()
    with pytest.raises(ValueError, match=r"tapped_layers \[5, 0\] must be distinct and ascending"):
        build_config(TrainConfig, DEBUG, "train", ["data.store=s", "data.tapped_layers=[5,0]"])
    # a store an earlier release wrote with its layers listed out of order trains ascending
    spec = FactorySpec(num_sequences=6, tapped_layers=[5, 0, 2])
    unordered = build_store(tmp_path / "unordered", spec)
    out = tmp_path / "run"
    sets = [f"data.store={unordered}", f"run.out={out}", "run.progress=false"]
    sets += ["optim.max_steps=1", "run.eval_every=0", "data.holdout_sequences=1"]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 2, 5]
    keys = [(0, 0, False)]
    as_stored = collate(sequences(unordered, None).__getitems__(keys))
    ascending = collate(sequences(unordered, [0, 2, 5]).__getitems__(keys))
    assert torch.equal(ascending.hidden_TKD, as_stored.hidden_TKD[:, [1, 2, 0]])


def test_a_run_that_read_the_layers_in_another_order_is_not_resumed(tmp_path: Path) -> None:
    # an earlier release trained a store written out of order in the store's order; its
    # checkpoint's fc expects that order, which this release would now read reordered
    unordered = build_store(
        tmp_path / "unordered", FactorySpec(num_sequences=6, tapped_layers=[5, 0, 2])
    )
    out = tmp_path / "run"
    sets = [f"data.store={unordered}", f"run.out={out}", "run.progress=false", "run.eval_every=0"]
    sets += ["data.holdout_sequences=1", "optim.max_steps=2", "run.checkpoint_every=1"]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    for meta_path in out.glob("**/meta.json"):  # as the earlier release wrote it
        meta = json.loads(meta_path.read_text())
        meta["target"]["tapped_layers"] = [5, 0, 2]
        meta_path.write_text(json.dumps(meta, indent=2))
    again = [*sets[:-2], "optim.max_steps=3", "run.checkpoint_every=1"]
    with pytest.raises(
        ValueError, match=r"the drafter's tapped layers: \[5, 0, 2\] -> \[0, 2, 5\]"
    ):
        run_train(build_config(TrainConfig, DEBUG, "train", again))
