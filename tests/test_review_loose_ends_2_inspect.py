"""`dflash inspect` and `dflash generate` folders. Given an unfinished generate folder, inspect
said to run `dflash extract` on it, which then refuses it as unfinished; it now says to rerun
the same generate first. And the summary of a store of generated chat rows showed the replies
cut at the token limit but not those another stop id than the end of turn ended (manifest
counts `other_stops`), which rows record alike (`wrote_end_of_turn` false).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from inspect_fixtures import build_store
from test_review_loose_ends_inspect import _manifest, _summary

from common.generated import MANIFEST, META_DIR
from dflash_offline.cli import main


@pytest.mark.parametrize("verify", [False, True], ids=["inspect", "inspect_verify"])
def test_an_unfinished_generate_folder_is_to_be_finished_first(
    tmp_path: Path, verify: bool
) -> None:
    gen = tmp_path / "gen"
    (gen / META_DIR).mkdir(parents=True)
    (gen / META_DIR / MANIFEST).write_text(json.dumps(_manifest(complete=False)))
    result = CliRunner().invoke(main, ["inspect", *(["verify"] if verify else []), str(gen)])
    assert result.exit_code != 0
    said = " ".join(result.output.split())
    assert (
        f"{gen} is an unfinished `dflash generate` output, not a store: rerun the same "
        "`dflash generate` command to finish it, then `dflash extract"
    ) in said, said
    # a finished one: extract it, as before
    (gen / META_DIR / MANIFEST).write_text(json.dumps(_manifest()))
    result = CliRunner().invoke(main, ["inspect", str(gen)])
    said = " ".join(result.output.split())
    assert f"{gen} is a `dflash generate` output, not a store: run `dflash extract" in said


@pytest.mark.parametrize("command", ["train", "evaluate-offline"])
def test_train_and_evaluate_offline_say_the_same_of_an_unfinished_one(
    tmp_path: Path, command: str
) -> None:
    """Every reader of a store opens it through the same root check (common.store), so train
    and evaluate-offline given that folder say to finish it too, not to run extract on it."""
    gen = tmp_path / "gen"
    (gen / META_DIR).mkdir(parents=True)
    (gen / META_DIR / MANIFEST).write_text(json.dumps(_manifest(complete=False)))
    if command == "train":
        args = ["train", "--store", str(gen), "--out", str(tmp_path / "run"), "--devices", "cpu"]
    else:
        args = ["evaluate-offline", "--store", str(gen), "--drafter", str(tmp_path / "none")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    said = " ".join(result.output.split())
    assert f"{gen} is an unfinished `dflash generate` output" in said, said


def test_the_summary_counts_replies_ended_by_another_stop(tmp_path: Path) -> None:
    counts = {"rows_out": 3, "new_tokens": 120, "truncated": 1, "other_stops": 2, "skipped": {}}
    text, s = _summary(build_store(tmp_path / "store").path, _manifest(counts=counts))
    assert (
        "3 rows, 120 new tokens, 1 replies cut at the limit, 2 ended by another stop than the "
        "end of turn, skipped {}\n"
    ) in text
    assert s["provenance"]["generation"]["counts"]["other_stops"] == 2
    # chunks of versions before it counted none: the line stays as it was
    older = {k: v for k, v in counts.items() if k != "other_stops"}
    text, _ = _summary(build_store(tmp_path / "older").path, _manifest(counts=older))
    assert "3 rows, 120 new tokens, 1 replies cut at the limit, skipped {}\n" in text
