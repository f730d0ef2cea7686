"""Training metrics: `RUN/metrics.jsonl` (one JSON object per optimizer step) and the log line.

On resume the file is cut back to the steps the checkpoint covers, so the file of a resumed run
reads exactly like the file of an uninterrupted one. The cut is written beside it and renamed
over it: a job killed at its start (a scheduler's SIGTERM or SIGKILL right after a requeue)
keeps the run's curves.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch


class MetricsWriter:
    """Appends one JSON line per step (rank 0 only)."""

    def __init__(self, path: Path, *, enabled: bool, keep_until: int) -> None:
        self.path, self.enabled = path, enabled
        if enabled and path.exists():
            kept = [r for r in read_records(path) if r["step"] <= keep_until]
            text = "".join(json.dumps(r) + "\n" for r in kept)
            if text != path.read_text():  # written in place, a kill mid-write lost the rest
                tmp = path.with_name(f".tmp-{path.name}")
                tmp.write_text(text)
                os.replace(tmp, path)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def check_finite_step(record: dict[str, Any], saved_step: int, store: str) -> None:
    """ValueError when a step's loss or gradient norm is NaN/Inf (every rank reads the same
    all-reduced figures, so every rank stops): the optimizer has already written non-finite
    weights, so nothing after it may be checkpointed, and the message says where it came from
    (a step that went on read as 'replicas diverged: [nan, nan]' at the next checkpoint, the
    store's NaN never named)."""
    loss, grad_norm = record["loss"], record["grad_norm"]
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    kept = f"the newest checkpoint (step {saved_step}) is intact" if saved_step else "none saved"
    raise ValueError(
        f"step {record['step']}: loss {loss}, gradient norm {grad_norm}: the drafter's weights "
        f"are no longer finite, so training stops without saving them ({kept}). Its sequences "
        f"(store rows) were {record['seqs']}. A store holding NaN/Inf features or logits trains "
        f"so: `dflash inspect verify {store}` names them (delete those shards and rerun the same "
        f"`dflash extract`); a clean store means the run diverged: lower optim.lr "
        f"({record['lr']:.3g}) or set optim.grad_clip"
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A last line without its newline is dropped: a run
    killed (or out of disk space) mid-write leaves one, and a run still writing may be caught
    mid-line by `dflash plot`; any other unreadable line is a ValueError naming it."""
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # the unterminated last line
                break
            raise ValueError(
                f"{path}, line {number} is not a JSON record ({err}); delete that line"
            ) from None
    return records


def memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated (GPU), or peak resident set size (CPU), in GB."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (1e9 if sys.platform == "darwin" else 1e6), 2)


def acceptance_by_position(acc_cond: list[float]) -> list[float]:
    """P(>= k drafted tokens accepted), k = 1..B-1, from the held-out `eval_acc_cond`: slot k's
    accuracy among blocks that accepted slots 1..k-1, so the running product is the share of
    blocks that accept at least k (its sum + 1 is `eval_tau`)."""
    out, reached = [], 1.0
    for p in acc_cond:
        reached *= p
        out.append(reached)
    return out


def _slots(values: list[float]) -> str:
    """Per-slot accuracies (slots 1..B-1) summarised: first, middle, last, mean."""
    if not values:
        return "-"
    mid = values[len(values) // 2]
    mean = sum(values) / len(values)
    return f"{values[0]:.3f}/{mid:.3f}/{values[-1]:.3f} (mean {mean:.3f})"


def format_line(record: dict[str, Any], total_steps: int) -> str:
    """One dense log line of a step record (and its evaluation, when it has one)."""
    line = (
        f"step {record['step']}/{total_steps} ep {record['epoch']} loss {record['loss']:.4f} "
        f"acc[1/mid/last] {_slots(record['acc'])} lr {record['lr']:.2e} "
        f"gnorm {record['grad_norm']:.3f} tok/s {record['tokens_per_s']:.0f} "
        f"mem {record['mem_gb']:.2f}GB"
    )
    if record.get("skipped_damaged"):  # data.on_damaged=skip
        line += f" skipped-damaged {record['skipped_damaged']}"
    if "eval_tau" in record:
        line += (
            f" | eval loss {record['eval_loss']:.4f} acc {_slots(record['eval_acc'])} "
            f"tau {record['eval_tau']:.3f} (marginal {record['eval_tau_marginal']:.3f})"
        )
    if record.get("dev_chained_tau") is not None:  # data.dev_store: the online tau, offline
        line += f" | dev chained tau {record['dev_chained_tau']:.3f}"
        if record.get("best_exported"):
            line += " (best so far: export-best/)"
    return line
