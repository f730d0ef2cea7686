"""A train key set off its default where the rest of the config leaves it unused warns at the
start, naming the key, its value, the key that overrides it and the fix; it trains as configured
(set together on purpose, both stay legal). It trained as the default does, without a word."""

from __future__ import annotations

from pathlib import Path

import pytest
from log_capture import dflash_messages

from common.config import build_config
from stage2_train.config import TrainConfig, ignored_notes
from stage2_train.train import run_train

REQUIRED = ["data.store=s", "run.out=o"]
CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))

# (the key as set, what leaves it unused, the cause the warning names, its fix, what applies it)
PAIRS = [
    ("run.pack_heads=true", ["run.compile_attention=false"], "run.compile_attention=false",
     "set run.compile_attention=true", ["run.compile_attention=true"]),
    ("run.pack_heads=true", ["run.devices=cpu"], "run.devices=cpu", "train on GPUs",
     ["run.devices=0"]),
    ("run.cuda_graphs=true", ["run.devices=cpu"], "run.devices=cpu", "train on GPUs",
     ["run.devices=0"]),
    ("optim.decay_ratio=0.5", ["optim.schedule=cosine"], "optim.schedule=cosine",
     "set optim.schedule=wsd", ["optim.schedule=wsd"]),
    ("loss.dpace_alpha=0.3", ["loss.weighting=decay"], "loss.weighting=decay",
     "set loss.weighting=dpace", ["loss.weighting=dpace"]),
    ("loss.distill_temperature=2", ["loss.distill_weight=0"], "loss.distill_weight=0",
     "set loss.distill_weight > 0", ["loss.distill_weight=0.5"]),
    ("data.prefetch=8", ["data.num_workers=0"], "data.num_workers=0",
     "set data.num_workers > 0", ["data.num_workers=2"]),
    ("data.follow_poll_s=0.5", [], "data.follow=false", "pass --follow", ["data.follow=true"]),
    ("data.follow_timeout_s=60", [], "data.follow=false", "pass --follow",
     ["data.follow=true"]),
    ("run.wandb_project=mine", [], "run.report_to lists no wandb",
     "set run.report_to=[wandb]", ["run.report_to=[wandb]"]),
    ("run.wandb_name=r1", ["run.report_to=[tensorboard]"], "run.report_to lists no wandb",
     "set run.report_to=[wandb]", ["run.report_to=[wandb]"]),
]  # fmt: skip


def notes(*sets: str, path: Path | None = None) -> list[str]:
    return ignored_notes(build_config(TrainConfig, path, "train", [*REQUIRED, *sets]))


def mentioning(found: list[str], key: str) -> list[str]:
    return [n for n in found if n.startswith(f"{key}=")]


@pytest.mark.parametrize(("setting", "unused_by", "named", "fix", "used_by"), PAIRS)
def test_an_ignored_key_warns_naming_its_value_the_cause_and_the_fix(
    setting: str, unused_by: list[str], named: str, fix: str, used_by: list[str]
) -> None:
    key = setting.split("=")[0]
    (note,) = mentioning(notes(setting, *unused_by), key)
    assert note.startswith(f"{key}=") and f" is ignored: {named}" in note, note
    assert f"; {fix}" in note and f"for it to apply, or drop {key} (default " in note, note


@pytest.mark.parametrize(("setting", "unused_by", "named", "fix", "used_by"), PAIRS)
def test_no_warning_at_the_default_or_where_the_key_applies(
    setting: str, unused_by: list[str], named: str, fix: str, used_by: list[str]
) -> None:
    key = setting.split("=")[0]
    assert mentioning(notes(*unused_by), key) == []  # the default, under the same combination
    assert mentioning(notes(setting, *used_by), key) == []  # the combination uses it


def test_the_values_are_written_as_set() -> None:
    found = notes(
        "run.pack_heads=true", "run.compile_attention=false", "loss.distill_temperature=2"
    )
    assert "run.pack_heads=true is ignored: run.compile_attention=false runs the SDPA" in found[0]
    assert found[0].endswith(
        "set run.compile_attention=true for it to apply, or drop run.pack_heads (default false)"
    )
    assert found[1].startswith("loss.distill_temperature=2.0 is ignored: loss.distill_weight=0")
    assert found[1].endswith("(default 1.0)")


def test_one_warning_per_key_the_cpu_first() -> None:
    # on the CPU, run.compile_attention=true would not apply it either: the CPU is named
    (note,) = notes("run.pack_heads=true", "run.compile_attention=false", "run.devices=cpu")
    assert "run.devices=cpu" in note and "train on GPUs" in note, note


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_shipped_configs_warn_of_nothing(path: Path) -> None:
    assert notes(path=path) == []


def test_train_logs_them_before_checking_the_store(tmp_path: Path) -> None:
    cfg = build_config(
        TrainConfig,
        None,
        "train",
        [f"data.store={tmp_path / 'none'}", f"run.out={tmp_path / 'run'}", "run.devices=cpu"]
        + ["optim.decay_ratio=0.5", "loss.dpace_alpha=0.3"],
    )
    with dflash_messages() as seen, pytest.raises(ValueError, match="none"):
        run_train(cfg)
    assert [m.split(" is ignored")[0] for m in seen if " is ignored: " in m] == [
        "optim.decay_ratio=0.5",
        "loss.dpace_alpha=0.3",
    ], seen
