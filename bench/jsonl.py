"""The JSON-lines results a device call leaves: written by the benchmarks (`emit_to`), read by
bench/*_summary.py (`read_jsonl`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of `path`; none when it is missing, and a line cut by a timeout is skipped
    (a part killed at its limit must not cost the summary of the others)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def emit_to(file_name: str) -> Callable[[dict[str, Any]], None]:
    """A benchmark's `emit(record)`: one JSON line to stdout and, where $OUT is set, appended to
    $OUT/`file_name` (what comes back from a device call)."""

    def emit(record: dict[str, Any]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if os.environ.get("OUT"):
            with open(Path(os.environ["OUT"]) / file_name, "a") as f:
                f.write(line + "\n")

    return emit
