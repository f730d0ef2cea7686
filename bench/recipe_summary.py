"""One variant of a pystd recipe run (bench/recipe_pystd.sh) in one JSON line: what BENCHMARKS.md
reports of it, read from the results folder a device call brings back.

    python bench/recipe_summary.py RESULTS VARIANT [--skip 50]

- the step (bench/fed_step_summary.py: medians, loader wait share, sequences/s),
- the run's end: last step, its lr (0 when the schedule ended annealed), peak memory,
- the time fit's decisions (`time limit: schedule shortened/lengthened` lines of the log),
- the evaluations (step, held-out tau, dev chained tau),
- online tau per prompt, DFlash and prompt lookup (VARIANT-acceptance.json: 128 tokens past a
  reply's end, the shared harness's definition), and the means; the same as `dflash evaluate`
  reports by default, replies ending at their end of sequence (VARIANT-acceptance-server.json,
  keys prefixed server_), and sampled as a server samples (VARIANT-acceptance-sampled.json,
  `dflash evaluate --temperature`: keys prefixed sampled_, its settings in `sampling`),
- the first step's seconds (its compilation: what the recipe's warm-up compile saves) and the
  stages' seconds (timings.json, with `wall_s`, the pipeline's wall time).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from fed_step_summary import summarize as step_figures  # bench/ is on sys.path
from jsonl import read_jsonl

DECISION = re.compile(r"time limit: schedule (shortened|lengthened) to end at step (\d+)")


def fit_decisions(train_log: Path) -> dict[str, Any]:
    """How often the time fit moved the schedule's end, and where it left it."""
    moves = DECISION.findall(train_log.read_text()) if train_log.is_file() else []
    return {
        "fit_decisions": len(moves),
        "fit_lengthened": sum(kind == "lengthened" for kind, _ in moves),
        "fit_last_end": int(moves[-1][1]) if moves else None,
    }


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object a stage wrote to `path`; {} when it wrote none (its log says why)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def online(acceptance: Path, prefix: str = "") -> dict[str, Any]:
    """Online tau (mean over prompts) and per prompt, DFlash and prompt lookup, the keys
    prefixed by `prefix`; {} when the evaluation wrote nothing."""
    record = read_json(acceptance)
    if not record:
        return {}
    out: dict[str, Any] = {}
    for method in ("dflash", "prompt_lookup"):
        figures = record.get(method, {})
        out[f"{prefix}{method}_tau"] = figures.get("tau")
        per_prompt = [round(t, 2) for t in figures.get("tau_per_prompt", [])]
        out[f"{prefix}{method}_tau_per_prompt"] = per_prompt
    return out


def summarize_variant(results: Path, variant: str, skip: int) -> dict[str, Any]:
    """Everything above for `variant` of the run whose files are in `results`."""
    metrics = results / f"{variant}-metrics.jsonl"
    steps = [r for r in read_jsonl(metrics) if "step" in r]
    if not steps:
        raise SystemExit(f"{metrics}: no training steps (did the variant train?)")
    last = steps[-1]
    evaluations = [
        {
            "step": r["step"],
            "eval_tau": r.get("eval_tau"),
            "dev_chained_tau": r.get("dev_chained_tau"),
        }
        for r in steps
        if "eval_tau" in r
    ]
    return {
        "variant": variant,
        **step_figures(metrics, skip),
        "first_step_s": steps[0].get("step_s") if steps[0]["step"] == 1 else None,
        "last_step": last["step"],
        "last_lr": last.get("lr"),
        "mem_gb": max(r.get("mem_gb", 0.0) for r in steps),
        **fit_decisions(results / f"{variant}-train.log"),
        "evaluations": evaluations,
        **online(results / f"{variant}-acceptance.json"),
        # as `dflash evaluate` reports by default (each reply ends at its end of sequence)
        **online(results / f"{variant}-acceptance-server.json", "server_"),
        # the target sampling (recipe_pystd.sh's SAMPLED_EVAL: temperature 0.6, top-p 0.95,
        # three seeds)
        **online(results / f"{variant}-acceptance-sampled.json", "sampled_"),
        "sampling": read_json(results / f"{variant}-acceptance-sampled.json").get("sampling"),
        "timings": read_json(results / "timings.json"),  # the stages' seconds, wall_s
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("results", type=Path, help="the recipe's $OUT (or a call's results/)")
    parser.add_argument("variant", help="the variant's name (VARIANTS=name|...; default: recipe)")
    parser.add_argument("--skip", type=int, default=50, help="steps left out (compilation)")
    args = parser.parse_args()
    print(json.dumps(summarize_variant(args.results, args.variant, args.skip)))


if __name__ == "__main__":
    main()
