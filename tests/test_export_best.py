"""run.export_best: RUN/export-best/ holds the drafter of the evaluation with the best
dev_chained_tau, as the checkpoint of that step had it; resume continues the record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from store_factory import FactorySpec, build_store

import stage2_train.train as train_module
from common.config import build_config
from stage2_train.best import BEST_DIR, BEST_FILE, best_record, best_so_far, dev_definition
from stage2_train.checkpoint import latest_checkpoint, read_meta
from stage2_train.config import TrainConfig
from stage2_train.export import load_export
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("best") / "store", FactorySpec(num_sequences=9))


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"data.dev_store={store}", f"run.out={out}"]
    base += ["run.progress=false", "data.holdout_sequences=1", "optim.max_steps=24"]
    base += ["run.eval_every=4", "run.checkpoint_every=4", "run.keep_checkpoints=10"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_best_evaluation_is_exported(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run that peaks mid-way (as an overfitting one does): the figures are scripted, the
    # weights and their export real.
    script = iter([1.5, 2.5, 2.0, 3.0, 3.0, 2.8])
    monkeypatch.setattr(
        train_module, "chained_tau_on_store", lambda *a, **k: {"chained_tau": next(script)}
    )
    out = tmp_path / "run"
    rows = train(store, out)
    evals = [(r["step"], r["dev_chained_tau"]) for r in rows if "dev_chained_tau" in r]
    assert evals == [(4, 1.5), (8, 2.5), (12, 2.0), (16, 3.0), (20, 3.0), (24, 2.8)]
    best_step = 16  # the first of equal bests: a later tie is not better
    record = json.loads((out / BEST_DIR / BEST_FILE).read_text())
    # and the dev store that figure is of: another one's figures are not compared with it
    assert record == {
        "step": best_step,
        "dev_chained_tau": 3.0,
        "dev_store": str(store),
        "dev_store_content_key": "factory-0",
        # and how it is defined: debug.yaml's block of 8, the factory tokenizer's eos
        "definition": dev_definition(8, [2]),
    }
    assert [r["step"] for r in rows if r.get("best_exported")] == [4, 8, 16]
    # the export holds that step's weights (bf16), as its checkpoint saved them
    weights = torch.load(out / f"step-{best_step:06d}" / "model.pt", weights_only=True)
    model = load_export(out / BEST_DIR)
    for name, tensor in weights.items():
        assert torch.equal(tensor.bfloat16(), model.state_dict()[name]), name


def test_off_exports_no_best(store: Path, tmp_path: Path) -> None:
    train(store, tmp_path / "run", "run.export_best=false", "optim.max_steps=8")
    assert not (tmp_path / "run" / BEST_DIR).exists()
    assert (tmp_path / "run" / "export" / "config.json").is_file()
    # named for `dflash export RUN`, which looks a null mask token up again
    meta = read_meta(latest_checkpoint(tmp_path / "run"))
    assert meta["tokenizer"] == {"name_or_path": "factory"}


def test_a_resumed_run_keeps_the_record_whatever_its_step(tmp_path: Path) -> None:
    dev = ("/data/dev", "key-a")
    definition = dev_definition(16, [2])
    assert best_so_far(tmp_path, *dev, definition) == -math.inf  # none yet
    (tmp_path / BEST_DIR).mkdir()
    (tmp_path / BEST_DIR / BEST_FILE).write_text(best_record(40, 3.5, *dev, definition))
    # whatever step the run resumes from: one killed after exporting its best and before its
    # next checkpoint redoes those steps, and export-best/ is replaced only by a better one
    assert best_so_far(tmp_path, *dev, definition) == 3.5
    # another dev store's figure (the same path re-extracted, or another path): not compared
    assert best_so_far(tmp_path, "/data/dev", "key-b", definition) == -math.inf
    # a record from before the dev store was recorded: taken as the current store's
    (tmp_path / BEST_DIR / BEST_FILE).write_text('{"step": 40, "dev_chained_tau": 3.5}')
    assert best_so_far(tmp_path, "/data/other", "key-b", definition) == 3.5
    (tmp_path / BEST_DIR / BEST_FILE).write_text("{not json")
    assert best_so_far(tmp_path, *dev, definition) == -math.inf


def test_the_real_figure_is_recorded(store: Path, tmp_path: Path) -> None:
    rows = train(store, tmp_path / "run", "optim.max_steps=8")
    taus = [r["dev_chained_tau"] for r in rows if "dev_chained_tau" in r]
    record = json.loads((tmp_path / "run" / BEST_DIR / BEST_FILE).read_text())
    assert record["dev_chained_tau"] == max(taus) >= 1.0
