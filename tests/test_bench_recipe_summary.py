"""bench/recipe_summary.py reads a recipe's results folder into the figures BENCHMARKS.md reports:
here a hand-made folder whose figures are known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_results(folder: Path) -> None:
    """60 steps of 2 sequences: 100 ms each (the first 30 s), steps 51-60 waited 50 ms for the loader; an
    evaluation at step 60, which ends at lr 0; three fit decisions; an online evaluation."""
    lines = []
    for step in range(1, 61):
        first = 30.0 if step == 1 else 0.1  # the first step compiles
        record = {"step": step, "step_s": first, "fetch_s": 0.05 if step > 50 else 0.0}
        record.update({"seqs": [[2 * step, 2 * step + 1]], "lr": 0.0 if step == 60 else 1e-3})
        record["mem_gb"] = 3.0 if step == 7 else 2.0
        if step == 60:
            record.update({"eval_tau": 5.5, "dev_chained_tau": 4.25})
        lines.append(json.dumps(record))
    (folder / "v-metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 61, "st')  # cut line
    (folder / "v-train.log").write_text(
        "10:00:00 training ...\n"
        "10:00:01 time limit: schedule shortened to end at step 55, cosine re-mapped (...)\n"
        "10:00:02 time limit: schedule lengthened to end at step 62, cosine re-mapped (...)\n"
        "10:00:03 time limit: schedule shortened to end at step 60, cosine re-mapped (...)\n"
    )
    acceptance = {
        "dflash": {"tau": 4.5, "tau_per_prompt": [3.0, 6.004]},
        "prompt_lookup": {"tau": 2.0, "tau_per_prompt": [1.5, 2.5]},
    }
    (folder / "v-acceptance.json").write_text(json.dumps(acceptance))
    server = {  # replies ended at their end of sequence: the second prompt dropped out
        "dflash": {"tau": 3.0, "tau_per_prompt": [3.0]},
        "prompt_lookup": {"tau": 1.5, "tau_per_prompt": [1.5]},
    }
    (folder / "v-acceptance-server.json").write_text(json.dumps(server))
    sampled = {  # dflash evaluate --temperature 0.6 --top-p 0.95
        "sampling": {"temperature": 0.6, "top_p": 0.95, "seed": 0},
        "dflash": {"tau": 2.5, "tau_per_prompt": [2.5]},
        "prompt_lookup": {"tau": 1.25, "tau_per_prompt": [1.25]},
    }
    (folder / "v-acceptance-sampled.json").write_text(json.dumps(sampled))
    (folder / "timings.json").write_text('{"generate_s": 300, "wall_s": 1400}\n')


def test_recipe_summary_reads_the_figures(tmp_path: Path) -> None:
    write_results(tmp_path)
    command = [sys.executable, str(ROOT / "bench" / "recipe_summary.py"), str(tmp_path), "v"]
    done = subprocess.run(command + ["--skip", "40"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["steps"] == 20 and summary["step_ms_median"] == 100.0
    assert summary["fetch_share"] == 0.25  # 10 of the 20 steps waited half their time
    assert summary["sequences_per_s"] == 20.0
    assert (summary["last_step"], summary["last_lr"], summary["mem_gb"]) == (60, 0.0, 3.0)
    assert (summary["fit_decisions"], summary["fit_lengthened"], summary["fit_last_end"]) == (
        3,
        1,
        60,
    )
    assert summary["evaluations"] == [{"step": 60, "eval_tau": 5.5, "dev_chained_tau": 4.25}]
    assert summary["dflash_tau"] == 4.5 and summary["dflash_tau_per_prompt"] == [3.0, 6.0]
    assert summary["prompt_lookup_tau_per_prompt"] == [1.5, 2.5]
    assert (summary["server_dflash_tau"], summary["server_prompt_lookup_tau"]) == (3.0, 1.5)
    assert summary["server_dflash_tau_per_prompt"] == [3.0]
    assert (summary["sampled_dflash_tau"], summary["sampled_prompt_lookup_tau"]) == (2.5, 1.25)
    assert summary["sampling"] == {"temperature": 0.6, "top_p": 0.95, "seed": 0}
    assert summary["first_step_s"] == 30.0
    assert summary["timings"] == {"generate_s": 300, "wall_s": 1400}


def test_recipe_summary_says_when_the_variant_did_not_train(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench" / "recipe_summary.py"), str(tmp_path), "none"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "none-metrics.jsonl: no training steps" in done.stderr
