"""Stage 1 on unusual but realistic inputs (a new user's walkthrough): each case either reads
and stores what README/FORMAT.md say, or fails naming the input and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from common.tiny import build_tokenizer, example_texts
from stage1_extract.config import DataConfig
from stage1_extract.data import load_raw_dataset, prepare_documents

ROWS = [{"text": f"document number {i}"} for i in range(4)]
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is a prime number?\nAnswer briefly."},
    {"role": "assistant", "content": "A number whose only divisors are one and itself."},
]


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def as_parts(message: dict, split: bool = False) -> dict:
    """`message` with its content as OpenAI's list of text parts (two when `split`: the
    first line and the rest, which vLLM joins by a newline)."""
    texts = message["content"].split("\n", 1) if split else [message["content"]]
    return {**message, "content": [{"type": "text", "text": t} for t in texts]}


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


def test_content_given_as_text_parts_is_their_text(tmp_path: Path) -> None:
    # OpenAI's content parts were refused ("content is not a string"), rows lost under skip
    tok = build_tokenizer(example_texts())
    reference = prepare_documents(
        DataConfig(path=str(write_jsonl(tmp_path / "plain.jsonl", [{"messages": CHAT}] * 2))), tok
    ).dataset
    parts = [as_parts(CHAT[0]), as_parts(CHAT[1], split=True), as_parts(CHAT[2])]
    # JSON Lines mixing strings and parts (a `Json` column), and Parquet of parts alone
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CHAT}, {"messages": parts}])
    datasets.Dataset.from_list([{"messages": parts}] * 2).to_parquet(str(tmp_path / "p.parquet"))
    for path in (mixed, tmp_path / "p.parquet"):
        got = prepare_documents(DataConfig(path=str(path)), tok)
        assert got.skipped == {}
        assert got.dataset["input_ids"][:] == reference["input_ids"][:]
        assert got.dataset["loss_mask"][:] == reference["loss_mask"][:]


def test_a_part_that_is_not_text_names_the_row(tmp_path: Path) -> None:
    tok = build_tokenizer(example_texts())
    image = {"type": "image_url", "image_url": {"url": "file:///x.png"}}
    user = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}
    rows = [{"messages": CHAT}, {"messages": [user, CHAT[2]]}]
    path = write_jsonl(tmp_path / "image.jsonl", rows)
    with pytest.raises(ValueError) as err:
        prepare_documents(DataConfig(path=str(path)), tok)
    assert f"data {path} row 1: message 0 content has a part that is not text ('image_url'" in str(
        err.value
    )
    skipped = prepare_documents(DataConfig(path=str(path), on_invalid="skip"), tok)
    assert skipped.skipped == {"non_text_content": 1}
    assert skipped.dataset["source_index"][:] == [0]


def test_a_folder_whose_file_names_name_splits_reads_data_split(tmp_path: Path) -> None:
    # a hub dataset's snapshot: every split was read as one (its test rows trained on)
    folder = tmp_path / "snapshot"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text("# card\n")
    for split, rows in (("train", ROWS[:3]), ("test", ROWS[3:])):
        name = f"data/{split}-00000-of-00001.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(folder / name))
    train = load_raw_dataset(DataConfig(path=str(folder)))
    assert train["text"] == [r["text"] for r in ROWS[:3]]
    test = load_raw_dataset(DataConfig(path=str(folder), split="test"))
    assert test["text"] == [ROWS[3]["text"]]
    message = load_error(DataConfig(path=str(folder), split="validation"))
    assert "names splits in its file names (test (1 files), train (1 files))" in message
    assert "but not 'validation'; choose one with --set data.split=NAME" in message
    # a file of no split would be left out unsaid by `datasets`: refused, named
    (tmp_path / "j").mkdir()
    write_jsonl(tmp_path / "j" / "train.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "j" / "extra.jsonl", ROWS[2:])
    message = load_error(DataConfig(path=str(tmp_path / "j")))
    assert "but 1 files belong to none, e.g. " + str(tmp_path / "j" / "extra.jsonl") in message
    # one split alone, or none named, is read whole as before
    (tmp_path / "j" / "extra.jsonl").rename(tmp_path / "j" / "train-2.jsonl")
    assert len(load_raw_dataset(DataConfig(path=str(tmp_path / "j")))) == 4


def test_a_bad_line_of_json_lines_in_a_json_file_is_named_by_its_line(tmp_path: Path) -> None:
    # `datasets` reads JSON Lines in a .json file too; its error named Arrow's "row 2"
    path = tmp_path / "rows.json"
    path.write_text(f'{json.dumps(ROWS[0])}\n{json.dumps(ROWS[1])}\n{{"text": x}}\n')
    message = load_error(DataConfig(path=str(path)))
    assert message.startswith(f"data file {path} line 3, column 10: Expecting value")


def test_a_folder_mixing_json_and_parquet_names_one_of_each(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    datasets.Dataset.from_list(ROWS[2:]).to_parquet(str(tmp_path / "b.parquet"))
    message = load_error(DataConfig(path=str(tmp_path)))
    assert f"(e.g. {tmp_path / 'a.jsonl'} and {tmp_path / 'b.parquet'})" in message
