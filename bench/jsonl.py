"""Reading the JSON-lines results a device call leaves (bench/*_summary.py)."""

from __future__ import annotations

import json
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
