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

from common.config import build_config
from common.store import open_store
from evaluation.offline import OfflineEvalConfig, run_offline_eval
from stage2_train.config import TrainConfig
from stage2_train.data import StoreSequences, collate
from stage2_train.inputs import check_inputs
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
STORED = [0, 2, 5]


@pytest.fixture(scope="module", params=["bfloat16", "float8_e4m3fn"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = FactorySpec(num_sequences=8, tapped_layers=STORED, hidden_dtype=request.param)
    return build_store(tmp_path_factory.mktemp("subset") / request.param, spec)


def sequences(store: Path, layers: list[int] | None, distill: bool = True) -> StoreSequences:
    return StoreSequences(
        open_store(store),
        num_anchors=8,
        per_document=False,
        block_size=4,
        label_target="argmax",
        distill=distill,
        seed=0,
        layers=layers,
    )


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
    cfg = build_config(
        TrainConfig,
        DEBUG,
        "train",
        [f"data.store={store}", "run.out=/nonexistent", f"data.tapped_layers={layers}"],
    )
    with pytest.raises(ValueError, match="data.tapped_layers"):
        check_inputs(cfg)


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
    ]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 5]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval_tau" in last
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
