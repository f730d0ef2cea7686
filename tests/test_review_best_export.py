"""Review (the best export and `dflash export` across interrupted and resumed training):

- export-best/best.json did not say which dev store its figure came from: a resume with
  another `data.dev_store` compared that store's figures against the old store's (a higher
  old figure blocked every later best export for good). best.json now records the dev store's
  content key; another store's record starts the comparison afresh, said in the log.
- A resumed run dropped a best.json written after its checkpoint (a run killed after
  exporting a best, before its next checkpoint) and exported at its first evaluation, even a
  worse drafter over the better one. It compares against best.json whatever its step now.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from store_factory import FactorySpec, build_store

import stage2_train.train as train_module
from common.config import build_config
from common.logging import get_logger
from stage2_train.best import BEST_DIR, BEST_FILE
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The training store (also the first dev store) and another dev store of its target."""
    root = tmp_path_factory.mktemp("best-review")
    train_store = build_store(root / "store", FactorySpec(num_sequences=9))
    return train_store, build_store(root / "dev2", FactorySpec(num_sequences=4, seed=1))


@pytest.fixture
def logged() -> list[str]:
    """The dflash logger's messages (it does not propagate to pytest's caplog)."""
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    get_logger().addHandler(handler)
    yield seen
    get_logger().removeHandler(handler)


def script_figures(monkeypatch: pytest.MonkeyPatch, *figures: float) -> None:
    """The dev evaluations' figures, in order (the weights and their exports stay real)."""
    script = iter(figures)
    monkeypatch.setattr(
        train_module, "chained_tau_on_store", lambda *a, **k: {"chained_tau": next(script)}
    )


def train(store: Path, dev: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"data.dev_store={dev}", f"run.out={out}"]
    base += ["run.progress=false", "data.holdout_sequences=1", "optim.max_steps=8"]
    base += ["run.eval_every=2", "run.checkpoint_every=4", "run.keep_checkpoints=5"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def remove(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()


def best_record(out: Path) -> dict:
    return json.loads((out / BEST_DIR / BEST_FILE).read_text())


def exported(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if r.get("best_exported")]


def test_another_dev_store_starts_the_best_afresh(
    stores: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logged: list[str]
) -> None:
    store, dev2 = stores
    out = tmp_path / "run"
    script_figures(monkeypatch, 3.0, 2.0, 2.5, 2.0)  # steps 2, 4, 6, 8 on the first dev store
    train(store, store, out)
    assert best_record(out) == {
        "step": 2,
        "dev_chained_tau": 3.0,
        "dev_store": str(store),
        "dev_store_content_key": "factory-0",
    }
    remove(out / "step-000008")  # killed after step 4's checkpoint
    remove(out / "export")
    # the second dev store reads lower for every drafter: its figures compare among themselves
    script_figures(monkeypatch, 1.2, 1.5, 1.4)
    rows = train(store, dev2, out)
    assert exported(rows[4:]) == [6, 8]
    assert best_record(out) == {
        "step": 8,
        "dev_chained_tau": 1.5,
        "dev_store": str(dev2),
        "dev_store_content_key": "factory-1",
    }
    said = [line for line in logged if "another dev store" in line]
    assert len(said) == 1 and "factory-0" in said[0] and "factory-1" in said[0], logged


def test_a_resumed_run_keeps_a_better_best_exported_after_its_checkpoint(
    stores: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = stores
    out = tmp_path / "run"
    script_figures(monkeypatch, 1.0, 1.5, 3.0, 2.0)  # the best at step 6, after step 4's save
    train(store, store, out)
    weights = (out / BEST_DIR / "model.safetensors").read_bytes()
    remove(out / "step-000008")  # killed after exporting step 6's best, before step 8's save
    remove(out / "export")
    script_figures(monkeypatch, 2.5, 2.8)  # the redone steps 6 and 8 read lower this time
    rows = train(store, store, out)
    assert exported(rows[4:]) == []
    assert best_record(out)["step"] == 6 and best_record(out)["dev_chained_tau"] == 3.0
    assert (out / BEST_DIR / "model.safetensors").read_bytes() == weights
