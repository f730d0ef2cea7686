"""Review (the best export and `dflash export` across interrupted and resumed training):

- export-best/best.json did not say which dev store its figure came from: a resume with
  another `data.dev_store` compared that store's figures against the old store's (a higher
  old figure blocked every later best export for good). best.json now records the dev store's
  content key; another store's record starts the comparison afresh, said in the log.
- A resumed run dropped a best.json written after its checkpoint (a run killed after
  exporting a best, before its next checkpoint) and exported at its first evaluation, even a
  worse drafter over the better one. It compares against best.json whatever its step now.
- export-best/ was exported, then best.json written after it: a kill between the two (the old
  export's removal lies between) left the drafter without its record, which the next run took
  for no best, replacing it at its first evaluation. best.json is written in the export's
  temporary folder now, committed by the same rename.
- `dflash export RUN` with a damaged newest checkpoint said "export an older one with --step
  N" without naming the steps there are, and a garbled model.pt or a meta.json without the
  drafter's shape failed as a bug (an unpickling error's page of advice, a KeyError). Each is
  named as damage now, with the command for each other kept checkpoint that looks whole.
- A resume past `optim.max_steps` (lowered with --allow-config-change) re-exported the
  checkpoint's drafter without a word (the log said "4 steps", then exported step 8's). A
  warning now says what it exports and names the `--step` of a kept step up to the new end.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from log_capture import dflash_messages
from store_factory import FactorySpec, build_store

import stage2_train.export as export_module
import stage2_train.train as train_module
from common.config import build_config
from dflash_offline.cli import main as cli
from stage2_train.best import BEST_DIR, BEST_FILE, dev_definition
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
    with dflash_messages(logging.INFO) as seen:
        yield seen


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
        "definition": dev_definition(8, [2]),  # debug.yaml's block, the factory's eos
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
        "definition": dev_definition(8, [2]),  # debug.yaml's block, the factory's eos
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


class Killed(Exception):
    """A kill at a chosen moment (the run stops there, nothing after it runs)."""


def test_a_kill_right_after_the_best_export_keeps_its_record(
    stores: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = stores
    out = tmp_path / "run"
    real = export_module.replace_folder
    commits = []

    def killed_after_the_third_best(tmp: Path, final: Path) -> None:
        real(tmp, final)
        commits.append(final)
        if final.name == BEST_DIR and len(commits) == 3:
            raise Killed  # right after the rename: the folder is there, nothing else ran

    monkeypatch.setattr(export_module, "replace_folder", killed_after_the_third_best)
    script_figures(monkeypatch, 1.0, 1.5, 3.0)  # the third best at step 6, after step 4's save
    with pytest.raises(Killed):
        train(store, store, out)
    assert best_record(out)["step"] == 6 and best_record(out)["dev_chained_tau"] == 3.0
    monkeypatch.setattr(export_module, "replace_folder", real)
    script_figures(monkeypatch, 2.5, 2.8)  # the redone steps 6 and 8 read lower this time
    rows = train(store, store, out)
    assert exported(rows[4:]) == [] and best_record(out)["step"] == 6


@pytest.fixture(scope="module")
def kept(stores: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder keeping checkpoints of steps 2, 4, 6 and 8 (copied by each test)."""
    store, _ = stores
    out = tmp_path_factory.mktemp("kept") / "run"
    sets = [f"data.store={store}", f"run.out={out}", "run.progress=false", "optim.max_steps=8"]
    sets += ["run.checkpoint_every=2", "run.keep_checkpoints=5"]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    return out


@pytest.mark.parametrize("damage", ["garbled", "emptied", "meta without shape", "other tensors"])
def test_export_of_a_damaged_checkpoint_names_the_steps_to_export(
    kept: Path, tmp_path: Path, damage: str
) -> None:
    out = tmp_path / "run"
    shutil.copytree(kept, out)
    newest = out / "step-000008"
    if damage == "garbled":  # torch.load's weights-only unpickler refuses it
        (newest / "model.pt").write_bytes(b"\x80\x02garbage" * 64)
    elif damage == "emptied":
        (newest / "model.pt").write_bytes(b"")
    elif damage == "meta without shape":
        meta = json.loads((newest / "meta.json").read_text())
        (newest / "meta.json").write_text(json.dumps({k: meta[k] for k in meta if k != "shape"}))
    else:
        (newest / "model.pt").write_bytes((out / "step-000002" / "optimizer.pt").read_bytes())
    (out / "step-000002" / "meta.json").write_text("{")  # damaged too: not offered
    result = CliRunner().invoke(cli, ["export", str(out), "--out", str(tmp_path / "x")])
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    what = {
        "garbled": "model.pt is unreadable (not a file torch.load reads)",
        "emptied": "model.pt is unreadable (EOFError: cut short)",
        "meta without shape": "meta.json lacks the drafter's 'shape'",
        "other tensors": "model.pt does not hold the drafter (",
    }[damage]
    assert lines[0].startswith(f"error: checkpoint {newest} is damaged ({what}"), lines[0]
    commands = f"`dflash export {out} --step 6` or `dflash export {out} --step 4`"
    assert lines[0].endswith(f"; export another kept checkpoint: {commands}"), lines[0]
    again = ["export", str(out), "--step", "6", "--out", str(tmp_path / "x")]
    assert CliRunner().invoke(cli, again).exit_code == 0
    assert (tmp_path / "x" / "model.safetensors").is_file()


def test_a_resume_past_its_lowered_last_step_says_what_it_exports(
    kept: Path, tmp_path: Path, logged: list[str]
) -> None:
    out = tmp_path / "run"
    shutil.copytree(kept, out)
    sets = [f"run.out={out}", "optim.max_steps=5", "run.allow_config_change=true"]
    store = json.loads((out / "step-000008" / "meta.json").read_text())["store"]
    sets += [f"data.store={store}", "run.progress=false", "run.checkpoint_every=2"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*sets, "run.keep_checkpoints=5"]))
    [said] = [line for line in logged if line.startswith("nothing to train")]
    assert "resumed at step 8, past the run's last step 5" in said
    assert f"{out}/export gets step 8's drafter" in said
    assert f"`dflash export {out} --step 4 --out FOLDER`" in said and "(kept: 2, 4)" in said
    assert f"exported the drafter of step 8 to {out / 'export'}" in logged
