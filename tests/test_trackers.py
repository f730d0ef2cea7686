"""Runs you can watch: `run.report_to` trackers (TensorBoard read back through its own
EventAccumulator, W&B offline), the PNG plots of a run and `dflash plot RUN`, `--version`, and
the choices `--help-config` lists."""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from click.testing import CliRunner
from log_capture import dflash_messages
from store_factory import FactorySpec, build_store

from common.config import build_config, describe, doc
from dflash_offline.cli import main as cli
from evaluation.heldout import summarize
from stage2_train import trackers
from stage2_train.config import TrainConfig
from stage2_train.metrics import MetricsWriter, acceptance_by_position
from stage2_train.plots import draw_plots_safely, plot_run
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
PLOTS = ("loss.png", "slot_accuracy.png", "acceptance.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HAS_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps with an evaluation every 4, reported to TensorBoard (and W&B when installed)."""
    root = tmp_path_factory.mktemp("track")
    store = build_store(root / "store", FactorySpec(num_sequences=13))
    report_to = ["tensorboard", "wandb"] if HAS_WANDB else ["tensorboard"]
    sets = [
        f"data.store={store}",
        f"run.out={root / 'run'}",
        "run.progress=false",
        "optim.max_steps=8",
        "run.eval_every=4",
        f"run.report_to={json.dumps(report_to)}",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # never the network, whatever the machine says
        run_train(build_config(TrainConfig, DEBUG, "train", sets))
    return root / "run"


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_events_hold_the_logged_scalars(run: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = records(run)
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 9))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    evals = [r for r in rows if "eval_tau" in r]
    tau = events.Scalars("eval/tau")
    assert [e.step for e in tau] == [4, 8]
    assert [e.value for e in tau] == pytest.approx([r["eval_tau"] for r in evals], rel=1e-6)
    slot3 = events.Scalars("eval/acc/slot_03")
    assert [e.value for e in slot3] == pytest.approx([r["eval_acc"][2] for r in evals], abs=1e-6)
    first = events.Scalars("eval/accept_ge/k_01")[-1].value
    assert first == pytest.approx(evals[-1]["eval_acc_cond"][0], abs=1e-6)
    tags = events.Tags()["scalars"]
    assert {"train/lr", "train/grad_norm", "train/acc/slot_07", "eval/loss"} <= set(tags)


def test_a_resume_hides_the_steps_past_the_checkpoint(tmp_path: Path) -> None:
    """A run killed after step 6 logged 5..6 past its checkpoint at 4: the resumed run logs them
    again, and TensorBoard shows each step once, as metrics.jsonl does."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = build_store(tmp_path / "store", FactorySpec(num_sequences=13))
    out = tmp_path / "run"
    sets = [
        f"data.store={store}",
        f"run.out={out}",
        "run.progress=false",
        "run.checkpoint_every=4",
        "run.report_to=[tensorboard]",
        "run.allow_config_change=true",
    ]
    run_train(build_config(TrainConfig, DEBUG, "train", [*sets, "optim.max_steps=6"]))
    shutil.rmtree(out / "step-000006")  # as if killed between checkpoints
    run_train(build_config(TrainConfig, DEBUG, "train", [*sets, "optim.max_steps=8"]))
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 9))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records(out)], rel=1e-6)


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_wandb_offline_writes_its_run_folder(run: Path) -> None:
    folders = list((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, folders
    run_id = (run / "wandb" / "run_id").read_text().strip()
    assert (folders[0] / f"run-{run_id}.wandb").stat().st_size > 0


def check_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def test_training_draws_the_plots_and_dflash_plot_redraws_them(run: Path) -> None:
    for name in PLOTS:
        check_png(run / "plots" / name)
        (run / "plots" / name).unlink()
    result = CliRunner().invoke(cli, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    for name in PLOTS:
        check_png(run / "plots" / name)
        assert str(run / "plots" / name) in result.output


def test_plot_without_evaluation_draws_the_loss_only(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 5.0 / s, "acc": [0.1, 0.0]} for s in range(1, 120)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png"]
    check_png(tmp_path / "plots" / "loss.png")
    result = CliRunner().invoke(cli, ["plot", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "metrics.jsonl does not exist" in result.output


def test_a_line_cut_mid_write_is_dropped_by_plot_and_resume(tmp_path: Path) -> None:
    """A run killed (or out of space) mid-write leaves a last line without its newline; a run
    still writing can be read mid-line. `dflash plot` and a resume read past it; a bad line
    elsewhere is one error naming it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "lo')
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    MetricsWriter(path, enabled=True, keep_until=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    path.write_text('{"step": 1, "loss": 5.0}\n{"st\n{"step": 2, "loss": 4.0}\n')
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 2 and "line 2 is not a JSON record" in result.output


def test_a_plotting_error_is_a_warning(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # no loss: the plot fails
    with dflash_messages() as seen:
        draw_plots_safely(tmp_path)
    assert any("could not draw the plots" in m for m in seen), seen


def test_acceptance_by_position_sums_to_tau() -> None:
    B = 6
    hist = torch.tensor([5.0, 3.0, 2.0, 0.0, 1.0, 1.0])  # blocks with exactly n accepted
    counts = {
        "correct": torch.full((B,), 4.0),
        "valid": torch.full((B,), 8.0),
        "accepted_hist": hist,
        "blocks": hist.sum(),
        "loss": torch.tensor(1.0),
        "weight": torch.tensor(1.0),
    }
    metrics = summarize(counts)
    curve = acceptance_by_position(metrics["eval_acc_cond"])
    expected = [float(hist[k:].sum() / hist.sum()) for k in range(1, B)]
    assert curve == pytest.approx(expected, abs=1e-3)
    assert 1 + sum(curve) == pytest.approx(metrics["eval_tau"], abs=1e-3)


def test_a_missing_tracker_package_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(trackers, "_installed", lambda package: package != "wandb")
    with pytest.raises(ValueError, match=r"pip install 'dflash-offline\[track\]'.*wandb"):
        trackers.check_trackers(["tensorboard", "wandb"])
    trackers.check_trackers(["tensorboard"])
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=4))
    args = ["train", "--config", str(DEBUG), "--store", str(store), "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(cli, [*args, "--set", "run.report_to=[wandb]"])
    assert result.exit_code == 2
    assert "error: run.report_to lists wandb, which is not installed" in result.output
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="must be one of"):
        build_config(TrainConfig, DEBUG, "train", ["run.report_to=[mlflow]"])


def test_version_names_the_package_torch_and_transformers() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    line = result.output.strip()
    assert line.startswith("dflash-offline ") and "\n" not in line
    assert f"torch {torch.__version__}" in line and "transformers " in line


@dataclass
class _Choices:
    mode: Literal["a", "b"] = doc("a", "a choice")
    maybe: Literal["x", "y"] | None = doc(None, "an optional choice")
    count: int = doc(3, "a plain field")


def test_report_to_as_a_bare_name_shows_the_list_form() -> None:
    with pytest.raises(ValueError, match=r"write it as \[tensorboard\]"):
        build_config(TrainConfig, None, "train", ["run.report_to=tensorboard"])


def test_help_config_lists_the_choices() -> None:
    assert describe(_Choices) == [
        "mode (one of: a, b; default 'a'): a choice",
        "maybe (one of: x, y, or null; default None): an optional choice",
        "count (int, default 3): a plain field",
    ]
    result = CliRunner().invoke(cli, ["train", "--help-config"])
    assert "run.dtype (one of: bfloat16, float32, mixed; default 'mixed')" in result.output
    assert "run.report_to (list of: tensorboard, wandb; default [])" in result.output
    result = CliRunner().invoke(cli, ["extract", "--help-config"])
    assert "data.format (one of: auto, messages, sharegpt, text, completion; default 'auto')" in (
        result.output
    )
