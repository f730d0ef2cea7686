"""Unreadable data files: the error names the file, the reason and the fix.

`datasets` hides an empty file behind a bare StopIteration and a bad JSON line behind a
generic DatasetGenerationError (stage1_extract/data_files.py finds the file and line).
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

from stage1_extract.config import DataConfig
from stage1_extract.data import load_raw_dataset


def load_error(path: Path) -> str:
    with pytest.raises(ValueError) as err:
        load_raw_dataset(DataConfig(path=str(path)))
    return str(err.value)


@pytest.mark.parametrize("name", ["zero.jsonl", "zero.parquet"])
def test_empty_file_is_named_with_the_fix(tmp_path: Path, name: str) -> None:
    (tmp_path / name).touch()
    message = load_error(tmp_path / name)
    assert message.startswith(f"data file {tmp_path / name} is empty: ")
    assert "--data" in message


def test_blank_and_empty_gzip_jsonl_are_empty(tmp_path: Path) -> None:
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with gzip.open(tmp_path / "zero.jsonl.gz", "wt"):
        pass
    for name in ("blank.jsonl", "zero.jsonl.gz"):
        assert load_error(tmp_path / name).startswith(f"data file {tmp_path / name} is empty: ")


def test_broken_jsonl_line_gives_file_line_and_cause(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "fine"}\n')
    (folder / "b.jsonl").write_text('{"text": "fine"}\n\n{"text": "b" x}\n')
    message = load_error(folder)
    assert message.startswith(f"data file {folder / 'b.jsonl'} line 3, column 14: Expecting ','")
    assert "An error occurred while generating" not in message
    assert "fix or remove" in message


def test_broken_json_file_gives_the_parser_cause(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text('[{"text": "a"}, {"text": ')
    message = load_error(path)
    assert message.startswith(f"could not read data {path}: ")
    assert "An error occurred while generating" not in message
    assert re.match(rf"could not read data {re.escape(str(path))}: \w+: \S", message)
    assert "fix or remove" in message
