"""Checkpoints of a training run: `OUT/step-000123/`, written atomically, newest k kept.

A checkpoint folder holds `model.pt` (the drafter's trainable state dict), `optimizer.pt`,
`scheduler.pt`, `rng-rank{r}.pt` (every rank's torch/numpy/python RNG states) and `meta.json`
(step, data position, the config, the store it trained on). It is written under
`OUT/.tmp-step-000123/` and renamed when every rank has finished writing, so a folder named
`step-*` is always complete; rerunning the same command resumes from the newest one.

Under data parallelism the model and optimizer are identical on every rank, so rank 0 writes
them; each rank writes its own RNG state.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.distributed import barrier
from common.durable import commit_folder

STEP_RE = re.compile(r"^step-(\d{6,})$")
TMP_PREFIX = ".tmp-"


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / f"step-{step:06d}"


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in out.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainState:
    """What a resume needs besides tensors: where training stands."""

    step: int  # optimizer steps done
    epoch: int  # epoch of the next step
    step_in_epoch: int  # optimizer steps of `epoch` already done
    tokens_seen: int = 0  # query tokens with a label, summed over ranks

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def save_checkpoint(
    out: str | Path,
    state: TrainState,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: dict[str, Any],
    rank: int,
    keep: int,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write `step-NNNNNN/` atomically from every rank (collective), prune to `keep`."""
    final = step_dir(out, state.step)
    tmp = final.with_name(TMP_PREFIX + final.name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        meta = {"train_state": state.to_dict(), "config": config, **(extra_meta or {})}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    barrier()
    if rank == 0:
        if final.exists():  # a step saved again after a resume: replace it whole
            shutil.rmtree(final)
        commit_folder(tmp, final)
        for old in list_checkpoints(out)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
    device: torch.device,
) -> tuple[TrainState, dict[str, Any]]:
    """Restore everything saved by `save_checkpoint`; returns the train state and meta."""
    meta = json.loads((path / "meta.json").read_text())
    model.load_state_dict(torch.load(path / "model.pt", map_location=device, weights_only=True))
    optimizer.load_state_dict(
        torch.load(path / "optimizer.pt", map_location=device, weights_only=True)
    )
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng-rank{rank}.pt"
    if rng_file.exists():  # absent when resuming with more ranks than were saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return TrainState(**meta["train_state"]), meta
