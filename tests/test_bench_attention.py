"""bench/bench_attention.py's CPU smoke mode: what its GPU runs compare is checked here too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cpu_sweep(tmp_path: Path, *flags: str) -> list[dict]:
    """The records of `bench_attention.py --sweep --device cpu --tiny FLAGS`, run as a script."""
    out = tmp_path / "att"  # not there yet: the bench makes it
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_attention.py"),
            *("--sweep", "--device", "cpu", "--tiny", *flags),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OUT": str(out)},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in (out / "attention_sweep.jsonl").open()]


@pytest.mark.parametrize(("layout", "flags"), [("tokens", ["--layout", "tokens"]), ("heads", [])])
def test_bench_attention_runs_in_either_layout_on_the_cpu(
    tmp_path: Path, layout: str, flags: list[str]
) -> None:
    """bench/bench_attention.py --layout: the project's region checks out against the fp32
    reference with q/k/v heads-major (the default, as training hands flex) and tokens-major
    (as the layers' projections write them), made so and handed so to flex by the region
    (DFLASH_FLEX_LAYOUT's switch, whose effect tests/test_model.py checks), and the results
    say which (a GPU A/B reads them); without --layout, heads-major."""
    records = cpu_sweep(tmp_path, "--only", "none", *flags)
    setup = next(r for r in records if r["what"] == "sweep_setup")
    baseline = next(r for r in records if r.get("name") == "project_region")
    assert setup["layout"] == setup["region_layout"] == layout
    assert baseline["valid"] is True and baseline["rel_err_out"] < 1e-5, baseline


def test_bench_attention_rounds_rank_by_the_median_of_each_rounds_figure(tmp_path: Path) -> None:
    """bench/bench_attention.py --sweep --rounds 2: the baseline and each chosen variant are
    measured once a round, every record names its round, and the summary's figure for each is
    the median of its rounds' records with their range (a ranking from one measurement each
    was not enough on H100s: forty-third session)."""
    records = cpu_sweep(tmp_path, "--only", "bwd16", "--rounds", "2")
    summary = next(r for r in records if r["what"] == "sweep_summary")
    for name in ("project_region", "bwd16"):
        mine = [r for r in records if r.get("name") == name]
        assert [r["round"] for r in mine] == [0, 1], mine
        figures = sorted(r["fwd_ms"] for r in mine)
        assert summary["spread"][name] == {
            "median": round((figures[0] + figures[1]) / 2, 4),
            "min": figures[0],
            "max": figures[1],
            "rounds": 2,
        }
    assert summary["baseline_ms"] == summary["spread"]["project_region"]["median"]
    best = min(summary["spread"], key=lambda n: summary["spread"][n]["median"])
    assert summary["best"] == best
