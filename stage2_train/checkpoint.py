"""Checkpoints of a training run: `OUT/step-000123/`, written atomically, newest k kept.

A checkpoint folder holds `model.pt` (the drafter's trainable state dict), `optimizer.pt`,
`scheduler.pt`, `rng-rank{r}.pt` (every rank's torch/numpy/python RNG states) and `meta.json`
(step, data position, the schedule's end fitted to a time limit, the config, the store it
trained on). It is written under `OUT/.tmp-step-000123/` and renamed when every rank has
finished writing, so a folder named `step-*` is always complete; rerunning the same command
resumes from the newest one.

Under data parallelism the model and optimizer are identical on every rank, so rank 0 writes
them; each rank writes its own RNG state.

A disk full or a file-size limit while writing removes the temporary folder and raises one
OutOfSpaceError naming the folder and the space needed; the previous checkpoints stay the
newest. `resume_latest` loads the newest checkpoint that reads back whole: a damaged one
(truncated or missing file, a rank's rng-rank{r}.pt too, bad meta.json) is skipped with a
warning naming what is wrong, and every rank falls back to the same one.

Pruning renames a folder to `.tmp-pruned-step-*` before deleting it, so a kill mid-delete
never leaves a half-deleted `step-*`. The temporary folders a killed run leaves (`.tmp-step-*`,
`.tmp-old-step-*` of `replace_folder`, `.tmp-pruned-step-*`) are removed by the next run of
that folder as it starts (`remove_leftovers`), whatever step it saves next; `dflash export`
takes a `.tmp-old-step-N` without `step-N` for step N too (`moved_aside`).

A file rank 0 cannot create, write, commit or remove in any of these steps (a permission
denied, a read-only or full disk) stops every rank at once, each naming that path and the fix
(common.distributed.failure_shared), where the other ranks used to wait for the process-group
timeout.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.distributed import failure_shared, gather_from_all_ranks
from common.durable import OutOfSpaceError, replace_folder, space_checked
from common.logging import get_logger
from stage2_train.schedule import FittedEnd

STEP_RE = re.compile(r"^step-(\d{6,})$")
TMP_PREFIX = ".tmp-"
PRUNED_PREFIX = ".tmp-pruned-"
# a checkpoint's temporary folders: being written, moved aside by replace_folder, being pruned
LEFTOVER_RE = re.compile(r"^\.tmp-(old-|pruned-)?(step-\d{6,})$")
# optim.fit_time_limit (stage2_train/time_fit.py): the schedule's end fitted to a time limit,
# flat in meta.json's train_state beside TrainState's fields (the run holds it in its
# ScheduleEnd alone): the end, the first step of the fitted curve, the decay's progress the
# step before (cosine, and wsd fitted mid-decay; None for wsd fitted before its decay), and
# the optim.schedule it was fitted under; all None when no end is fitted. A resume continues
# that curve as planned. Checkpoints from before wsd could be re-mapped have no fit_schedule:
# then a progress meant cosine, and none wsd.
FIT_KEYS = ("fit_end", "fit_decay_from", "fit_progress", "fit_schedule")


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


def moved_aside(out: str | Path) -> dict[int, Path]:
    """The steps of `out` left only as `.tmp-old-step-N` (a save of step N again, killed
    between the two renames of `replace_folder`: step N whole as it was), by step, oldest
    first. `remove_leftovers` renames them back as a run starts; `dflash export` reads them."""
    out = Path(out)
    if not out.is_dir():
        return {}
    found = {}
    for path in out.iterdir():
        m = LEFTOVER_RE.match(path.name)
        if m and m.group(1) == "old-" and path.is_dir() and not (out / m.group(2)).exists():
            found[int(STEP_RE.match(m.group(2)).group(1))] = path
    return dict(sorted(found.items()))


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
    # --follow (stage2_train/follow.py): epoch 0 streams the store in shard order; a resume
    # keeps that order. Its data position is step_in_epoch, as in shuffled epochs;
    # streamed_sequences says what it consumed: sequences [0, n) of the store, all ranks.
    stream: bool = False
    streamed_sequences: int = 0

    def to_dict(self, fitted: FittedEnd | None = None) -> dict[str, int | float | None]:
        """meta.json's train_state: these fields, then `fitted` as FIT_KEYS."""
        values = (None,) * 4
        if fitted is not None:
            values = (fitted.end, fitted.decay_from, fitted.progress, fitted.schedule)
        return {**self.__dict__, **dict(zip(FIT_KEYS, values, strict=True))}


def saved_train_state(meta: dict[str, Any]) -> TrainState:
    """A checkpoint's meta.json train_state as a TrainState (its fitted end: `fitted_end`);
    DamagedCheckpoint when it is malformed."""
    try:
        saved = meta["train_state"]
        return TrainState(**{key: v for key, v in saved.items() if key not in FIT_KEYS})
    except (TypeError, AttributeError) as err:  # not a dict, or not TrainState's fields
        raise DamagedCheckpoint(f"meta.json train_state is malformed ({err})") from err


def fitted_end(train_state: dict[str, Any]) -> FittedEnd | None:
    """The fitted end a checkpoint's train_state records (`TrainState.to_dict`); None when
    none was fitted, or the checkpoint predates fitting."""
    if train_state.get("fit_end") is None:
        return None
    progress = train_state.get("fit_progress")
    schedule = train_state.get("fit_schedule") or ("wsd" if progress is None else "cosine")
    return FittedEnd(
        train_state["fit_end"], train_state["fit_decay_from"], progress, schedule=schedule
    )


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: about what torch.save writes for it."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


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
    fitted: FittedEnd | None = None,
) -> Path:
    """Write `step-NNNNNN/` atomically from every rank (collective), prune to `keep`;
    `fitted`: the schedule's end fitted to a time limit, if any (ScheduleEnd.fitted)."""
    final = step_dir(out, state.step)
    tmp = final.with_name(TMP_PREFIX + final.name)
    previous = latest_checkpoint(out)
    resume = "rerun the same command to resume" + (f" from {previous.name}" if previous else "")
    unsaved = f"{final.name} was not saved; make {out} writable for this user, then {resume}"
    with failure_shared(), _fix_named(unsaved):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    model_state = model.state_dict()
    optim_state = optimizer.state_dict()
    needed = state_bytes(model_state) + state_bytes(optim_state)
    no_space = f"free space on that disk, then {resume}"
    try:
        with (
            failure_shared(),
            _fix_named(unsaved),
            space_checked("checkpoint", final, needed, no_space),
        ):
            torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
            if rank == 0:
                torch.save(model_state, tmp / "model.pt")
                torch.save(optim_state, tmp / "optimizer.pt")
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
                train_state = state.to_dict(fitted)
                meta = {"train_state": train_state, "config": config, **(extra_meta or {})}
                (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        with failure_shared():
            if rank == 0:  # a step saved again after a resume replaces the old folder whole
                with _fix_named(unsaved), space_checked("checkpoint", final, needed, no_space):
                    replace_folder(tmp, final)
                _prune(out, state.step, keep)
    except BaseException:
        # after every rank has written or failed (failure_shared): a half-written folder must
        # not fill the disk; it is never a checkpoint (committed, there is no tmp left)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _prune(out: str | Path, step: int, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints up to `step`; a newer, damaged one waits to
    be replaced."""
    older = [p for p in list_checkpoints(out) if _step(p) < step]
    saved = step_dir(out, step).name
    fix = (
        f"{saved} is saved whole; remove that folder (or make it writable for this user), "
        f"then rerun the same command to resume from {saved}"
    )
    for old in older[: max(len(older) - (keep - 1), 0)]:
        aside = old.with_name(PRUNED_PREFIX + old.name)
        with _fix_named(fix):
            old.rename(aside)  # a kill mid-delete leaves a temporary folder, not a step-* one
            shutil.rmtree(aside)


@contextmanager
def _fix_named(fix: str) -> Iterator[None]:
    """An OSError of the body (a permission denied, a read-only disk) raised again with its
    path and `fix` in its message, which is all that the other ranks see of it
    (failure_shared); an OutOfSpaceError names its own fix."""
    try:
        yield
    except OSError as err:
        if isinstance(err, OutOfSpaceError):
            raise
        where = f": {err.filename}" if err.filename else ""
        raise OSError(err.errno, f"{err.strerror or err}{where}; {fix}") from err


def remove_leftovers(out: str | Path, rank: int) -> None:
    """Remove the temporary folders a killed save or prune left in `out` (collective; rank 0
    removes, holding the run folder's lock, train.run_lock): a later save removes only those
    of the step it writes, which a changed cadence or an earlier resume never writes again.
    A `.tmp-old-step-N` without `step-N` (killed between replace_folder's two renames) is
    step N whole as it was before that save (the new copy may be half-written): it is renamed
    back, not removed. A folder rank 0 cannot rename or remove stops every rank, naming it."""
    out = Path(out)
    with failure_shared():
        if rank == 0 and out.is_dir():
            _remove_leftovers(out)


RERUN = "then rerun the same command"


def _remove_leftovers(out: Path) -> None:
    removed, restored = [], []
    for path in sorted(out.iterdir()):  # .tmp-old-step-N before .tmp-step-N
        if not (m := LEFTOVER_RE.match(path.name)) or not path.is_dir():
            continue
        final = out / m.group(2)
        if m.group(1) == "old-" and not final.exists():
            with _fix_named(f"rename it to {final.name} (it is that step, whole), {RERUN}"):
                path.rename(final)
            restored.append(path.name)
        else:  # never a checkpoint: the user may remove it as well as we would
            with _fix_named(f"remove that folder (or make it writable for this user), {RERUN}"):
                shutil.rmtree(path)
            removed.append(path.name)
    log = get_logger()
    if removed:
        names = ", ".join(removed)
        log.info("removed the temporary checkpoint folders a killed run left in %s: %s", out, names)
    for name in restored:
        log.info(
            "renamed %s in %s back to its step-* name (a killed run had moved it aside)",
            name,
            out,
        )


def _step(path: Path) -> int:
    return int(STEP_RE.match(path.name).group(1))


class DamagedCheckpoint(Exception):
    """A checkpoint folder that does not read back whole; the message says what is wrong."""


# What torch.load and json raise on a truncated, emptied or garbled file.
_READ_ERRORS = (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, KeyError)


def _read(path: Path, what: str, reader: Callable[[Path], Any]) -> Any:
    if not path.is_file():
        raise DamagedCheckpoint(f"{what} is missing")
    try:
        return reader(path)
    except pickle.UnpicklingError as err:  # torch's weights-only load: a page of advice
        raise DamagedCheckpoint(f"{what} is unreadable (not a file torch.load reads)") from err
    except _READ_ERRORS as err:
        detail = str(err).strip() or "cut short"  # an empty file's EOFError says nothing
        raise DamagedCheckpoint(f"{what} is unreadable ({type(err).__name__}: {detail})") from err


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of checkpoint `path`; DamagedCheckpoint when missing, not JSON, or incomplete."""
    meta = _read(path / "meta.json", "meta.json", lambda p: json.loads(p.read_text()))
    if not isinstance(meta, dict) or not {"train_state", "config"} <= set(meta):
        raise DamagedCheckpoint("meta.json lacks train_state or config")
    return meta


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """model.pt of checkpoint `path`, on the CPU (`dflash export`); DamagedCheckpoint when
    missing or unreadable (truncated, emptied, garbled: torch.load's weights-only unpickler
    refuses garbage as an UnpicklingError)."""
    return _read(
        path / "model.pt",
        "model.pt",
        lambda p: torch.load(p, map_location="cpu", weights_only=True),
    )


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
    device: torch.device,
) -> tuple[TrainState, dict[str, Any]]:
    """Restore everything saved by `save_checkpoint`; returns the train state and meta (its
    fitted end: `fitted_end(meta["train_state"])`).
    DamagedCheckpoint when a file is missing or does not read back (nothing is applied then:
    every file is read before any state is set)."""
    meta = read_meta(path)

    def tensors(name: str, weights_only: bool = True, to: torch.device | str = device) -> Any:
        return _read(
            path / name,
            name,
            lambda p: torch.load(p, map_location=to, weights_only=weights_only),
        )

    model_state, optim_state = tensors("model.pt"), tensors("optimizer.pt")
    sched_state = tensors("scheduler.pt")
    # this rank's own RNG state, damage when missing like any other file (another world size
    # is refused before, by resume.check_same_run): without it the rank would go on from the
    # state it happened to have. RNG states stay on the CPU: torch.set_rng_state and cuda's
    # set_rng_state_all take CPU ByteTensors (mapped to the GPU, a GPU resume failed)
    rng = tensors(f"rng-rank{rank}.pt", weights_only=False, to="cpu")
    state = saved_train_state(meta)
    model.load_state_dict(model_state)
    optimizer.load_state_dict(regroup_optimizer_state(optim_state, optimizer, model))
    scheduler.load_state_dict(sched_state)
    groups = len(optimizer.param_groups)
    if len(scheduler.base_lrs) == 1 and groups > 1:  # one group saved: regroup_optimizer_state
        scheduler.base_lrs = scheduler.base_lrs * groups
        scheduler._last_lr = scheduler._last_lr * groups
    set_rng_state(rng)
    return state, meta


def _problems_of_all_ranks(problem: str | None) -> list[str]:
    """What every rank found wrong with its checkpoint, each once (none: all read it whole), so
    that all fall back together and rank 0, which logs, names a file only another rank read
    (its rng-rank{r}.pt)."""
    return list(dict.fromkeys(p for p in gather_from_all_ranks(problem) if p))


def resume_latest(
    out: str | Path,
    check: Callable[[dict[str, Any], Path], None],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int,
    device: torch.device,
) -> tuple[TrainState, dict[str, Any], Path] | None:
    """Load the newest checkpoint of `out` that reads back whole, newest first (collective).

    `check(meta, path)` runs on each candidate's meta before its tensors load (a ValueError
    there, e.g. another config, stops the resume: it is not damage). A damaged checkpoint is
    skipped with a warning; None when `out` has no checkpoint, ValueError when all are damaged.
    """
    found = list_checkpoints(out)
    problems = []
    for i in range(len(found) - 1, -1, -1):
        path = found[i]
        try:
            meta = read_meta(path)
            check(meta, path)
            state, meta = load_checkpoint(
                path,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                rank=rank,
                device=device,
            )
            problem = None
        except DamagedCheckpoint as err:
            problem = f"{path.name}/{err}"
        if not (found_here := _problems_of_all_ranks(problem)):
            return state, meta, path
        problems.append("; ".join(found_here))
        if i > 0:
            get_logger().warning(
                "checkpoint %s is damaged: %s; falling back to %s", path, problems[-1], found[i - 1]
            )
    if not found:
        return None
    raise ValueError(
        f"every checkpoint in {out} is damaged ({'; '.join(problems)}); move them away to "
        "train from the start, or pass another --out"
    )


def regroup_optimizer_state(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """An optimizer state saved with one parameter group (checkpoints written before the
    weight-decay groups of `schedule.param_groups`), renumbered into `optimizer`'s groups;
    any other state as it is. In one group, index i is the i-th trainable parameter of the
    model; torch numbers the parameters of several groups one group after the other."""
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != 1 or len(groups) == 1:
        return saved
    trainable = [p for p in model.parameters() if p.requires_grad]
    position = {id(p): i for i, p in enumerate(q for g in groups for q in g["params"])}
    if len(trainable) != len(position) or len(saved["param_groups"][0]["params"]) != len(position):
        return saved  # not that layout: load_state_dict explains what differs
    new_index = [position[id(p)] for p in trainable]
    old_group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
    regrouped = []
    for group in groups:
        indices = [position[id(p)] for p in group["params"]]
        decay = group.get("decay", True)
        regrouped.append(
            {
                **old_group,
                "weight_decay": old_group.get("weight_decay", 0.0) if decay else 0.0,
                "decay": decay,
                "params": indices,
            }
        )
    state = {new_index[int(i)]: value for i, value in saved["state"].items()}
    return {"state": state, "param_groups": regrouped}
