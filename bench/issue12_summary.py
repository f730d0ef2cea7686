"""Summary of one `bench/issue12_call.sh` run: reads the JSON lines it left in OUT and writes a
short text report (OUT/summary.txt, also printed). Tolerates missing files and cut lines: a
part that failed or was skipped shows as such.

    python bench/issue12_summary.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

from jsonl import read_jsonl  # bench/ is on sys.path: scripts run as bench/x.py

GOAL_MS = 0.45  # issue 12: fwd+bwd at the seed shape


def parts_lines(parts: list[dict]) -> list[str]:
    lines = ["## Parts (limit, wall, exit code; 124/137 = stopped at its limit)"]
    for p in parts:
        if p.get("status") == "skipped":
            lines.append(f"- {p['part']}: skipped ({p.get('reason', '')})")
        else:
            state = "TIMED OUT" if p.get("timed_out") else ("ok" if p.get("rc") == 0 else "FAILED")
            lines.append(
                f"- {p['part']}: {state}, rc {p.get('rc')}, {p.get('wall_s')} s of {p.get('limit_s')} s"
            )
    return lines


def attention_lines(sweep: list[dict], yard: list[dict]) -> list[str]:
    lines = ["## Attention at the seed shape (fwd+bwd ms, triton do_bench medians)"]
    if not sweep and not any("fwdbwd_ms" in y for y in yard):
        return [*lines, "not run in this call"]
    interval = next((y for y in yard if y.get("v") == "interval_mod bs128"), None)
    variants = [r for r in sweep if r.get("what") == "sweep_variant"]
    base = next((r for r in variants if r.get("name") == "project_region"), None)
    base_ms = base.get("fwd_bwd_ms") if base else None
    y_ms = interval.get("fwdbwd_ms") if interval else None
    lines.append(
        f"project region {base_ms} ms; yardstick interval form {y_ms} ms"
        + (f" (ratio {base_ms / y_ms:.2f})" if base_ms and y_ms else "")
        + f"; goal {GOAL_MS} ms"
    )
    lines.append(
        f"{'variant':<20} {'status':<8} {'tile':<8} {'fwd':>7} {'fwd+bwd':>8} "
        f"{'speedup':>7} {'valid':>5}  note"
    )
    for r in variants:
        tile = "x".join(map(str, r.get("tile", []))) or "-"
        note = r.get("error") or r.get("reason") or ""
        if r.get("valid") is False:
            note = "INVALID (errors vs fp32 above 3x baseline) " + note
        lines.append(
            f"{r.get('name', '?'):<20} {r.get('status', '-'):<8} {tile:<8} "
            f"{r.get('fwd_ms', '-'):>7} {r.get('fwd_bwd_ms', '-'):>8} "
            f"{r.get('speedup_vs_project', '-'):>7} {str(r.get('valid', '-')):>5}  {note[:90]}"
        )
    summary = next((r for r in sweep if r.get("what") == "sweep_summary"), None)
    if summary:
        best, best_ms = summary.get("best"), summary.get("best_ms")
        met = best_ms is not None and best_ms <= GOAL_MS
        lines.append(f"best valid: {best} at {best_ms} ms; goal {'MET' if met else 'not met'}")
    else:
        lines.append("no sweep summary line: the sweep was cut before its end")
    return lines


def train_lines(rows: list[dict], yard: list[dict]) -> list[str]:
    lines = ["## Training step (synthetic batches through StepRunner, no loader)"]
    ystep = next((y for y in yard if "step_ms" in y), None)
    if ystep:
        lines.append(
            f"yardstick train step (8B shape, bf16): {ystep['step_ms']} ms, "
            f"{ystep.get('query_tok_per_s')} query tok/s, MFU {ystep.get('mfu_vs_790')}, "
            f"peak {ystep.get('peak_GB')} GB"
        )
    for r in rows:
        what, tag = r.get("what"), f"{r.get('shape')}, compile_layers={r.get('compile_layers')}"
        if r.get("variant"):  # a part run with --set overrides (issue12_call.sh tags it)
            tag += f", {r['variant']}"
        if what == "train_step" and r.get("status") == "error":
            lines.append(f"{tag}: ERROR {r.get('error')}")
        elif what == "train_step":
            ratio = ""
            if ystep and r.get("shape") == "qwen3-8b":
                ratio = f", {r['median_step_ms'] / ystep['step_ms']:.2f}x the yardstick's step"
            lines.append(
                f"{tag}: {r['median_step_ms']} ms/step (first {r['first_step_s']} s), "
                f"{r['query_tokens_per_s']} query tok/s, {r['achieved_TFLOPs']} TFLOP/s, MFU "
                f"{r['mfu_vs_790']}, peak {r.get('peak_gpu_GB')} GB{ratio}"
            )
        elif what == "train_profile":
            lines.append(
                f"  profile ({r['unit']}): {r['kernel_ms_per_step']} ms of kernels per "
                f"{r['step_ms_while_profiled']} ms step (busy {r['busy_share']})"
            )
            cats = sorted(r["categories"].items(), key=lambda kv: -kv[1]["ms_per_step"])
            lines.append(
                "    " + ", ".join(f"{c} {v['ms_per_step']} ms ({v['share']:.0%})" for c, v in cats)
            )
            for k in r["top_kernels"][:6]:
                lines.append(
                    f"    {k['ms_per_step']:>8} ms {k['calls_per_step']:>6}x  "
                    f"[{k['category']}] {k['name'][:80]}"
                )
        elif what == "compile_layers_effect":
            lines.append(
                f"{r['shape']}: compile_layers speedup {r['speedup']} (step ms {r['step_ms']}, "
                f"first step s {r['first_step_s']}, peak GB {r['peak_gpu_GB']})"
            )
    return lines


def main() -> None:
    out = Path(sys.argv[1])
    parts = read_jsonl(out / "parts.jsonl")
    yard = read_jsonl(out / "yardsticks.jsonl")
    text = [
        "# issue 12 device call",
        *parts_lines(parts),
        "",
        *attention_lines(read_jsonl(out / "attention_sweep.jsonl"), yard),
        "",
        *train_lines(read_jsonl(out / "train_profile.jsonl"), yard),
    ]
    report = "\n".join(text) + "\n"
    (out / "summary.txt").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
