"""Step time, loader wait and sequences per second from a training run's metrics.jsonl.

Skips the first SKIP steps (compilation). `fetch_s` is the time the step waited for the
loader's batch; `step_s` is the wall time from one step's start to the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from jsonl import read_jsonl  # bench/ is on sys.path: scripts run as bench/x.py


def summarize(metrics_path: Path, skip: int) -> dict[str, float | int]:
    """The steady-state figures of one run: medians, quantiles and totals after `skip` steps."""
    # a line the run's timeout cut is left out; a missing file has no steps
    steps = [r for r in read_jsonl(metrics_path) if "step_s" in r and r.get("step", 0) > skip]
    if not steps:
        raise SystemExit(f"{metrics_path}: no training steps after step {skip}")
    step_s = [r["step_s"] for r in steps]
    fetch_s = [r.get("fetch_s", 0.0) for r in steps]
    sequences = sum(len(sum(r["seqs"], [])) for r in steps)
    waited = sorted(fetch_s)
    return {
        "steps": len(steps),
        "step_ms_median": round(1000 * statistics.median(step_s), 1),
        "step_ms_mean": round(1000 * statistics.fmean(step_s), 1),
        "fetch_ms_median": round(1000 * statistics.median(fetch_s), 1),
        "fetch_ms_p90": round(1000 * waited[int(0.9 * (len(waited) - 1))], 1),
        "fetch_share": round(sum(fetch_s) / sum(step_s), 3),
        "sequences_per_s": round(sequences / sum(step_s), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--skip", type=int, default=50, help="steps left out (compilation)")
    parser.add_argument("--workers", type=int, default=None, help="recorded beside the figures")
    args = parser.parse_args()
    print(json.dumps({"workers": args.workers, **summarize(args.metrics, args.skip)}))


if __name__ == "__main__":
    main()
