"""Summary of one `bench/follow_call.sh` run (issue 13): the sequential and the --follow run's
wall times, the gain, what the follow train waited for, and whether its streamed epoch read
every committed training sequence once. Reads what the script left in LOGS; a phase that
failed, timed out or was skipped shows as such, and the figures that need it are null.

    python bench/follow_summary.py LOGS OUT.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from jsonl import read_jsonl  # bench/ is on sys.path: scripts run as bench/x.py

EXTRACT_LOOP = re.compile(r"rank 0: (\d+) shards, (\d+) tokens in ([\d.]+) s \((\d+) tokens/s")
WAITING = re.compile(
    r"^(\d\d:\d\d:\d\d) .*caught up with extraction of \S+: waiting for (.+?) "
    r"\((\d+) shards committed\)"
)
HELD_OUT = re.compile(r"\((\d+) held out\)")


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def timeline(path: Path) -> list[tuple[float, int, int]]:
    """(time, committed shards, training steps done) samples."""
    rows = []
    for line in read_text(path).splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def first_time(samples: list[tuple[float, int, int]], column: int, at_least: int) -> float | None:
    return next((s[0] for s in samples if s[column] >= at_least), None)


def since(t: float | None, start: float | None) -> float | None:
    return None if t is None or start is None else round(t - start, 1)


def phase_wall(phase: dict[str, Any] | None) -> float | None:
    return None if not phase or "end" not in phase else round(phase["end"] - phase["start"], 1)


def phase_state(phase: dict[str, Any] | None) -> str:
    if not phase:
        return "not run"
    if phase.get("skipped"):
        return "skipped"
    rc = phase["rc"]
    return "ok" if rc == 0 else ("timed out" if rc in (124, 137) else f"failed (rc {rc})")


def steps_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Step count and timing of a run's metrics rows; loader_wait = time outside the step
    itself (step_s - compute_s): waiting for the batch, in --follow also for its shard."""
    if not rows:
        return {"steps": 0}
    epoch0 = [r for r in rows if r.get("epoch") == 0]
    return {
        "steps": len(rows),
        "epoch0_steps": len(epoch0),
        "median_step_s": round(statistics.median(r["step_s"] for r in rows), 4),
        "median_compute_s": round(statistics.median(r["compute_s"] for r in rows), 4),
        "epoch0_loader_wait_s": round(sum(r["step_s"] - r["compute_s"] for r in epoch0), 1),
        "last_eval_tau": next((r["eval_tau"] for r in reversed(rows) if "eval_tau" in r), None),
        "last_loss": rows[-1].get("loss"),
    }


def extract_loop(log: str) -> dict[str, Any] | None:
    match = EXTRACT_LOOP.search(log)
    if not match:
        return None
    shards, tokens, seconds, rate = match.groups()
    return {"shards": int(shards), "tokens": int(tokens), "loop_s": float(seconds),
            "tokens_per_s": int(rate)}  # fmt: skip


def store_attrs(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())["attributes"]["dflash"]
    except (OSError, ValueError, KeyError):
        return {}


def streamed_epoch(rows: list[dict[str, Any]], num_train: int | None) -> dict[str, Any]:
    """What the follow run's epoch 0 read: store order from sequence 0, each once; every
    training sequence when the run went past it (steps = the epoch's length)."""
    reads = [i for r in rows if r.get("epoch") == 0 for rank in r["seqs"] for i in rank]
    kept = [i for i in reads if i >= 0]
    per_step = sum(len(rank) for rank in rows[0]["seqs"])
    steps = -(-num_train // per_step) if num_train else None
    return {
        "num_train": num_train,
        "steps": steps,
        "sequences_per_step": per_step,
        "reads": len(kept),
        "unique": len(set(kept)),
        "padding_items": len(reads) - len(kept),
        "in_store_order_once": kept == list(range(len(kept))),
        "every_sequence_once": num_train is not None and kept == list(range(num_train)),
    }


def summarize(logs: Path) -> dict[str, Any]:
    notes = [
        line.split("=", 1) for line in read_text(logs / "meta.txt").splitlines() if "=" in line
    ]
    settings = {k: v for k, v in notes if k != "problem"}
    problems = [v for k, v in notes if k == "problem"]
    phases = {p["phase"]: p for p in read_jsonl(logs / "phases.jsonl")}
    for name in ("seq_extract", "seq_train", "follow_extract", "follow_train"):
        if (state := phase_state(phases.get(name))) != "ok":
            problems.append(f"{name}: {state}")
    ok = all(phase_state(phases.get(n)) == "ok" for n in phases) and len(phases) == 4

    seq_rows = read_jsonl(logs / "seq-metrics.jsonl")
    fol_rows = read_jsonl(logs / "follow-metrics.jsonl")
    seq_steps, fol_steps = steps_of(seq_rows), steps_of(fol_rows)

    seq_extract, seq_train = (
        phase_wall(phases.get("seq_extract")),
        phase_wall(phases.get("seq_train")),
    )
    seq_total = round(seq_extract + seq_train, 1) if seq_extract and seq_train else None
    seq_line = timeline(logs / "seq-timeline.txt")
    seq_train_start = phases.get("seq_train", {}).get("start")
    sequential = {
        "extract_s": seq_extract,
        "train_s": seq_train,
        "total_s": seq_total,
        "extract": phase_state(phases.get("seq_extract")),
        "train": phase_state(phases.get("seq_train")),
        "extract_loop": extract_loop(read_text(logs / "seq_extract.log")),
        # train start-up: process start, store checks, worker, loader, compile of step 1
        "train_first_step_s": since(first_time(seq_line, 2, 1), seq_train_start),
        **seq_steps,
    }

    fol_ex, fol_tr = phases.get("follow_extract", {}), phases.get("follow_train", {})
    start = min((p["start"] for p in (fol_ex, fol_tr) if "start" in p), default=None)
    fol_total = since(fol_tr.get("end"), start)
    fol_line = timeline(logs / "follow-timeline.txt")
    n0 = fol_steps.get("epoch0_steps")
    train_log = read_text(logs / "follow_train.log")
    waits = [
        {"at": m.group(1), "for": m.group(2), "shards_committed": int(m.group(3))}
        for m in map(WAITING.match, train_log.splitlines())
        if m
    ]
    first_step = since(first_time(fol_line, 2, 1), start)
    follow = {
        "total_s": fol_total,
        "extract_s": since(fol_ex.get("end"), start),
        "extract": phase_state(fol_ex or None),
        "train": phase_state(fol_tr or None),
        "extract_loop": extract_loop(read_text(logs / "follow_extract.log")),
        "first_shard_s": since(first_time(fol_line, 1, 1), start),
        "first_step_s": first_step,
        "streamed_epoch_end_s": since(first_time(fol_line, 2, n0), start) if n0 else None,
        "wait_log_lines": len(waits),
        "waits": waits[:40],
        **fol_steps,
    }
    # what the follow train lost against training alone: waiting for shards (and sharing the
    # host with extract); the same steps and settings, so the difference is the overlap's cost
    if fol_total is not None and seq_train is not None and ok:
        follow["train_idle_s"] = round(fol_total - seq_train, 1)
    if first_step is not None and sequential["train_first_step_s"] is not None:
        follow["start_delay_s"] = round(first_step - sequential["train_first_step_s"], 1)
    if n0 and seq_steps.get("epoch0_steps") == n0:
        follow["stream_wait_s"] = round(
            fol_steps["epoch0_loader_wait_s"] - seq_steps["epoch0_loader_wait_s"], 1
        )
    if "start_delay_s" in follow and "stream_wait_s" in follow:  # waited for shards, in all
        follow["wait_s"] = round(follow["start_delay_s"] + follow["stream_wait_s"], 1)

    seq_attrs, fol_attrs = (
        store_attrs(logs / "seq-store.json"),
        store_attrs(logs / "follow-store.json"),
    )
    counts = fol_attrs.get("counts", {})
    held = HELD_OUT.search(train_log)
    num_train = counts["sequences"] - int(held.group(1)) if "sequences" in counts and held else None
    stream = streamed_epoch(fol_rows, num_train) if fol_rows else {}
    if stream and not stream["in_store_order_once"]:
        problems.append("the streamed epoch did not read the store in order, each sequence once")
    n_full = stream.get("steps")
    if n_full and len(fol_rows) > n_full and not stream["every_sequence_once"]:
        problems.append("the streamed epoch is over but did not read every training sequence")
    same_store = bool(seq_attrs) and all(
        seq_attrs.get(k) == fol_attrs.get(k) for k in ("content_key", "counts")
    )
    if not same_store:
        problems.append("the two stores differ (or one is missing): not the same data")

    summary: dict[str, Any] = {
        "ok": ok and not problems,
        "settings": settings,
        "sequential": sequential,
        "follow": follow,
        "gain": round(seq_total / fol_total, 3) if ok and seq_total and fol_total else None,
    }
    steps = seq_steps.get("steps", 0)
    if ok and seq_total and seq_train and seq_extract and n_full and steps:
        # the follow run cannot beat training alone, nor end its streamed epoch before extraction
        # (or, ending inside it, before extraction reaches its last read); then the rest of the
        # steps and the run's end (last evaluation, checkpoint, export) as in the sequential run
        if steps >= n_full:
            end_s = since(phases["seq_train"]["end"], first_time(seq_line, 2, steps)) or 0.0
            floor = seq_extract + (steps - n_full) * seq_steps["median_step_s"] + end_s
        else:
            loop = (sequential["extract_loop"] or {}).get("loop_s", seq_extract)
            floor = seq_extract - loop + loop * steps / n_full
        floor = max(seq_train, floor)
        summary["follow_floor_s"] = round(floor, 1)
        summary["gain_bound"] = round(seq_total / floor, 3)
    summary["store"] = {
        "same_in_both_runs": same_store,
        "num_shards": fol_attrs.get("num_shards"),
        **{k: counts.get(k) for k in ("sequences", "documents", "tokens", "padding_tokens")},
    }
    summary["streamed_epoch"] = stream
    summary["problems"] = problems
    return summary


def main() -> None:
    logs, out = Path(sys.argv[1]), Path(sys.argv[2])
    summary = summarize(logs)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
