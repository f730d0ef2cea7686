"""Stage 1 on unusual but realistic inputs (a new user's walkthrough): each case either reads
and stores what README/FORMAT.md say, or fails naming the input and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from stage1_extract.config import DataConfig
from stage1_extract.data import load_raw_dataset

ROWS = [{"text": f"document number {i}"} for i in range(4)]


def load_error(cfg: DataConfig) -> str:
    with pytest.raises(ValueError) as err:
        load_raw_dataset(cfg)
    return str(err.value)


def test_bad_line_after_a_bom_is_named_by_its_own_line(tmp_path: Path) -> None:
    # a BOM before line 1 (what Windows editors write); `datasets` reads past it, so the
    # bad line is line 3, not the BOM's line 1
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(ROWS[0]), json.dumps(ROWS[1]), '{"text": broken', json.dumps(ROWS[2])]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8-sig")
    message = load_error(DataConfig(path=str(path)))
    assert message.startswith(f"data file {path} line 3, column 10: Expecting value")


def test_a_bom_and_a_trailing_blank_line_read_every_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n", encoding="utf-8-sig")
    assert load_raw_dataset(DataConfig(path=str(path)))["text"] == [r["text"] for r in ROWS]


def test_save_to_disk_folders_are_read(tmp_path: Path) -> None:
    # its state.json and dataset_info.json were read as JSON rows: "CastError: Couldn't cast"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    parts = {"train": ROWS[:3], "test": ROWS[3:]}
    splits = datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in parts.items()})
    splits.save_to_disk(str(tmp_path / "dict"))
    one = load_raw_dataset(DataConfig(path=str(tmp_path / "one"), max_samples=3))
    assert one["text"] == [r["text"] for r in ROWS[:3]]
    train = load_raw_dataset(DataConfig(path=str(tmp_path / "dict")))
    assert train["text"] == [r["text"] for r in ROWS[:3]]
    test = load_raw_dataset(DataConfig(path=str(tmp_path / "dict"), split="test"))
    assert test["text"] == [ROWS[3]["text"]]
    message = load_error(DataConfig(path=str(tmp_path / "dict"), split="validation"))
    assert "has no split 'validation', only ['test', 'train']" in message
    assert "--set data.split=NAME" in message
