"""Local data files: which `datasets` builder reads them, and errors that name the file, the
line and the fix (the `datasets` errors name neither: "An error occurred while generating the
dataset", or a message that ends in a colon for an empty file).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import datasets
from datasets.data_files import DataFilesList, get_data_patterns

from common.logging import get_logger

log = get_logger()

# file suffix -> `datasets` builder; longest suffixes first so ".jsonl.gz" wins over ".gz"
LOCAL_BUILDERS = {
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
# what `Dataset.save_to_disk` (state.json) and `DatasetDict.save_to_disk` write at the top
SAVED_MARKERS = ("state.json", "dataset_dict.json")
EMPTY_FIX = "it holds no rows; remove it, or point --data at a file or folder with rows"
READ_FIX = {
    "json": "fix or remove the file (JSON Lines: one object per line; .json: one array of "
    "objects), then rerun",
    "parquet": "rewrite or remove the file (it is not a readable Parquet file), then rerun",
}


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    return next((b for suffix, b in LOCAL_BUILDERS.items() if name.endswith(suffix)), None)


def _split_files(folder: Path, files: list[Path], split: str) -> list[Path]:
    """`files` of `split` where their names name splits as `datasets` names a hub dataset's
    (`data/train-00000-of-00001.parquet`, `test/`, `validation.jsonl`): read whole, such a
    folder gave every split as one, a test set trained on, and data.split went unused. A
    folder of one split, or of none (`part-*.jsonl.gz`), is read whole as before."""
    by_split = {
        str(name): {Path(f).resolve() for f in DataFilesList.from_patterns(p, str(folder))}
        for name, p in get_data_patterns(str(folder)).items()
    }
    resolved = {f.resolve(): f for f in files}
    in_splits = {name: [f for f in resolved if f in got] for name, got in by_split.items()}
    in_splits = {name: got for name, got in in_splits.items() if got}
    if len(in_splits) <= 1 and all(len(got) == len(files) for got in in_splits.values()):
        return files
    counts = ", ".join(f"{name} ({len(got)} files)" for name, got in sorted(in_splits.items()))
    loose = [str(f) for r, f in resolved.items() if not any(r in g for g in in_splits.values())]
    if loose:  # `datasets` would leave them out unsaid
        raise ValueError(
            f"data folder {folder} names splits in its file names ({counts}), but "
            f"{len(loose)} files belong to none, e.g. {loose[0]}; move them into a split's "
            "files, or point --data at one file or subfolder"
        )
    if split not in in_splits:
        raise ValueError(
            f"data folder {folder} names splits in its file names ({counts}) but not "
            f"{split!r}; choose one with --set data.split=NAME"
        )
    log.info("data folder %s: reading split %r of %s (data.split)", folder, split, counts)
    return [resolved[f] for f in in_splits[split]]


def local_data_files(path: Path, split: str = "train") -> tuple[str, list[str]]:
    """The `datasets` builder and the sorted data files of a local file or folder (of `split`
    where the folder's file names name splits)."""
    accepted = ", ".join(LOCAL_BUILDERS)
    if path.is_file():
        builder = _builder_for(path)
        if builder is None:
            raise ValueError(f"data file {path}: unsupported file type; use one of {accepted}")
        return builder, [str(path)]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and _builder_for(p)
        and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    if not files:
        raise ValueError(f"data folder {path} holds no {accepted} files; point --data at one")
    files = _split_files(path, files, split)
    builders = {_builder_for(p) for p in files}
    if len(builders) > 1:
        first = {_builder_for(p): p for p in reversed(files)}
        raise ValueError(
            f"data folder {path} mixes JSON and Parquet files (e.g. {first['json']} and "
            f"{first['parquet']}); keep one kind per folder"
        )
    return builders.pop(), [str(p) for p in files]


def looks_local(path: str) -> bool:
    """A path that can only mean a local file: hub names are `name` or `org/name`, no suffix."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or path.count("/") > 1
        or _builder_for(Path(path)) is not None
    )


def _holds_lines(name: str, opener: Any) -> bool:
    """Whether a .json(.gz) file `datasets` failed on holds JSON Lines (which it reads in a
    .json file too, naming a bad line by Arrow's row in a block): not one JSON document, and
    its first text an object's, not an array's."""
    with opener(name, "rt", encoding="utf-8-sig", errors="replace") as f:
        text = f.read()
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return text.lstrip().startswith("{")
    return False


def _json_lines_problem(files: list[str]) -> str | None:
    """The error for the first empty .jsonl(.gz) file or bad line among `files`, read with the
    stdlib: the errors of `datasets` name neither the file nor the line (Arrow counts rows per
    block)."""
    for name in files:
        opener = gzip.open if name.lower().endswith(".gz") else open
        if not name.lower().endswith((".jsonl", ".jsonl.gz")) and not _holds_lines(name, opener):
            continue
        rows = 0
        # utf-8-sig: a BOM before the first line (Windows editors write one) is no JSON, and
        # `datasets` reads past it; as utf-8 it would be blamed for a bad line further on
        with opener(name, "rt", encoding="utf-8-sig", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return (
                        f"data file {name} line {number}, column {err.colno}: {err.msg}; fix or "
                        "remove that line (each line must be one JSON object), then rerun"
                    )
                rows += 1
        if not rows:
            return f"data file {name} is empty: {EMPTY_FIX}"
    return None


def _cause(err: BaseException) -> str:
    """The most specific message of an exception chain: `datasets` wraps the parser's error in
    a generic DatasetGenerationError, and an empty compressed file ends in a bare StopIteration."""
    seen: BaseException | None = err
    while seen is not None:
        if str(seen) and not isinstance(seen, datasets.exceptions.DatasetGenerationError):
            return f"{type(seen).__name__}: {seen}"
        seen = seen.__cause__ or seen.__context__
    return type(err).__name__


def _load_saved(path: Path, split: str) -> datasets.Dataset:
    """A folder written by `Dataset.save_to_disk` (or a DatasetDict's, one folder per split)."""
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as err:
        raise ValueError(
            f"could not read data {path} (a datasets.save_to_disk folder): {_cause(err)}; "
            "save it again, or point --data at its rows as .jsonl or .parquet files"
        ) from err
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(
                f"data {path} (a datasets.save_to_disk folder) has no split {split!r}, only "
                f"{sorted(saved)}; choose one with --set data.split=NAME"
            )
        return saved[split]
    return saved


def load_local(path: Path, split: str) -> datasets.Dataset:
    """`datasets.load_dataset` of a local file or folder (`datasets.load_from_disk` of a
    `save_to_disk` folder); a failure names the file, the reason and the fix."""
    # a save_to_disk folder holds Arrow files beside JSON metadata (state.json,
    # dataset_info.json), which the JSON builder would read as rows ("Couldn't cast")
    if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS):
        return _load_saved(path, split)
    builder, files = local_data_files(path, split)
    if empty := [f for f in files if os.path.getsize(f) == 0]:
        raise ValueError(f"data file {empty[0]} is empty: {EMPTY_FIX}")
    try:
        return datasets.load_dataset(builder, data_files={split: files}, split=split)
    except Exception as err:  # malformed JSON/Parquet surfaces as many exception types
        problem = _json_lines_problem(files) if builder == "json" else None
        fix = READ_FIX[builder]
        raise ValueError(problem or f"could not read data {path}: {_cause(err)}; {fix}") from err
