"""The target model has one flag under two names: generate and extract call it `--model`,
evaluate and convert `--target`; each command takes the other name too, for the same value
(a user who typed one in the last command was told "No such option" by the next)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

import dflash_offline.convert
import evaluation.online
import stage1_extract.run
import stage1_generate.run
from dflash_offline.cli import main


def _captured(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[tuple]:
    """Replace `module.name` by a recorder of its arguments (the command's work not run)."""
    calls: list[tuple] = []
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


@pytest.mark.parametrize("flag", ["--model", "--target"])
@pytest.mark.parametrize(
    ("command", "module", "function"),
    [
        ("generate", stage1_generate.run, "run_generate"),
        ("extract", stage1_extract.run, "run_extract"),
    ],
)
def test_stage_commands_take_either_name(
    monkeypatch: pytest.MonkeyPatch, command: str, module: Any, function: str, flag: str
) -> None:
    calls = _captured(monkeypatch, module, function)
    result = CliRunner().invoke(main, [command, flag, "some/target", "--data", "d", "--out", "o"])
    assert result.exit_code == 0, result.output
    ((cfg, model_name), _kwargs) = calls[0]
    assert cfg.target.model == "some/target" and model_name == "--model"


@pytest.mark.parametrize("flag", ["--target", "--model"])
def test_evaluate_takes_either_name(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(evaluation.online, "run_evaluate", lambda cfg: seen.append(cfg) or {})
    result = CliRunner().invoke(main, ["evaluate", flag, "some/target", "--data", "d"])
    assert result.exit_code == 0, result.output
    assert seen[0].target == "some/target"


@pytest.mark.parametrize("flag", ["--target", "--model"])
def test_convert_takes_either_name(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    calls = _captured(monkeypatch, dflash_offline.convert, "run_convert")
    result = CliRunner().invoke(main, ["convert", "in.h5", "store", flag, "some/target"])
    assert result.exit_code == 0, result.output
    assert calls[0][1]["target"] == "some/target"
