"""`run.export_best`: the drafter at its best `dev_chained_tau` so far, exported when reached.

The dev chained tau (`data.dev_store`) is the online tau computed offline, prompt by prompt,
and a run that overfits its data peaks before its last step (BENCHMARKS.md: pystd-28m flat
from step 7,500 of 10,000). So each evaluation that beats the best so far exports the drafter
to RUN/export-best/ (the same files as RUN/export/, which stays the final drafter) and then
writes best.json there: its step and figure. A resumed run continues from best.json when its
step is not past the resumed step (a later one belongs to steps the run is about to redo).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

BEST_DIR = "export-best"
BEST_FILE = "best.json"


def best_so_far(out: Path, resumed_step: int) -> float:
    """The dev_chained_tau recorded in RUN/export-best/best.json, or -inf (none yet, unreadable,
    or from a step after `resumed_step`)."""
    try:
        record = json.loads((out / BEST_DIR / BEST_FILE).read_text())
        step, tau = int(record["step"]), float(record["dev_chained_tau"])
    except (OSError, ValueError, KeyError, TypeError):
        return -math.inf
    return tau if step <= resumed_step else -math.inf


def record_best(out: Path, step: int, tau: float) -> None:
    """Write best.json into the freshly exported RUN/export-best/ (atomic: tmp, then rename)."""
    path = out / BEST_DIR / BEST_FILE
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps({"step": step, "dev_chained_tau": tau}) + "\n")
    os.replace(tmp, path)
