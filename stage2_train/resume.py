"""Resuming `dflash train` from its newest readable checkpoint, with the config it was run with.

A rerun of `dflash train --out RUN` compares its config with the checkpoint's, field by field:

- fields a resume can never change (`FIXED_ON_RESUME`: the drafter's shape and mask token,
  what the saved data position means, the parameter dtype), and another store or world size,
  are refused, listing `field: old -> new`;
- fields that steer only how the run executes (`FREE_ON_RESUME`) may differ freely;
- every other field (lr, schedule, steps, loss, anchors, `run.fp8_linear`: it changes the
  arithmetic, not the saved state) is refused the same way unless
  `--allow-config-change` (`run.allow_config_change`), which applies each and logs it: the
  optimizer's lr, betas and weight decay, and the schedule's peak lr, warmup, floor and length
  all follow the new config from the resumed step on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from common.logging import get_logger
from stage2_train.checkpoint import (
    STEP_RE,
    TrainState,
    fitted_end,
    list_checkpoints,
    remove_leftovers,
    resume_latest,
    saved_train_state,
)
from stage2_train.config import OptimConfig, TrainConfig
from stage2_train.follow import FollowPlan, check_stream_position
from stage2_train.plan import EpochPlan
from stage2_train.schedule import FittedEnd, refresh_lr

# The drafter's weights, and the data position's meaning (order, split, batch layout).
FIXED_ON_RESUME = (
    "drafter",
    "data.seed",
    "data.holdout_sequences",
    "data.tapped_layers",  # the drafter's input width (its fc layer) and what it reads
    "optim.batch_sequences",
    "optim.grad_accum",
    "run.dtype",
)
# Where and how the run executes; never what it computes (the store is compared by content).
FREE_ON_RESUME = (
    "drafter.init_norm_from_target",  # only the initial weights, which the checkpoint replaces
    "data.dev_store",
    "run.out",
    "run.export_best",
    "run.devices",
    "run.progress",
    "run.log_every",
    "run.gc_every",
    "run.read_metrics_late",  # when a step's metrics are read, not what they hold (a test)
    "run.eval_every",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.time_limit_s",  # each job of a run gets its own wall-clock limit
    "run.compile_attention",
    "run.compile_layers",
    "run.cuda_graphs",  # how the compiled layers' kernels are launched, not what they compute
    "run.pack_heads",  # the same attention with its rows in another order (as compile_layers)
    "run.allow_config_change",
    "run.report_to",
    "run.wandb_project",
    "run.wandb_name",
    "run.seed",  # only the initial weights, which the checkpoint replaces
    "data.store",
    "data.num_workers",
    "data.prefetch",
    "data.prefetch_to_device",  # the same batches, fetched and copied earlier (prefetch.py)
    # what a damaged sequence does: stop the run (which then never trained past it) or skip
    # it; the advice of that stop's error, which a rerun follows from the newest checkpoint
    "data.on_damaged",
    "data.follow_poll_s",  # --follow: how often and how long to wait for extraction
    "data.follow_timeout_s",
    # the same loss in another rounding order (as run.compile_layers): free like it
    "loss.head_chunk_tokens",
    "loss.compile_chunks",
)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _under(key: str, roots: tuple[str, ...]) -> bool:
    return any(key == r or key.startswith(r + ".") for r in roots)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(fixed, changeable) differences between two config dicts, as `field: old -> new`. A
    field the saved config lacks (added in a later version) counts as its default value."""
    old = _flat(dataclasses.asdict(TrainConfig())) | _flat(saved)
    new = _flat(current)
    fixed, changeable = [], []
    for key in sorted(new):  # a field removed since the checkpoint was written is gone
        if _under(key, FREE_ON_RESUME) or old.get(key) == new.get(key):
            continue
        line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        (fixed if _under(key, FIXED_ON_RESUME) else changeable).append(line)
    return fixed, changeable


def check_same_run(
    meta: dict[str, Any],
    current: dict[str, Any],
    world: int,
    path: Path,
    store_key: str,
    allow_change: bool = False,
    layers: list[int] | None = None,
    shape: dict[str, Any] | None = None,
) -> list[str]:
    """Refuse to resume checkpoint `path` under another config (see the module docstring);
    returns the changes to apply when `allow_change`.

    The store is compared by its content key, not its path: a store re-extracted in place with
    other data is another store, and `./store` vs `/abs/store` is the same one. The drafter is
    compared by `shape` (model.DrafterShape as a dict), what its config resolves to against
    the store, as data.tapped_layers by `layers`.
    """
    fixed, changeable = config_changes(meta["config"], current)
    saved_shape = meta.get("shape")
    if shape is not None and saved_shape is not None:
        # drafter.* spelled another way (a default set to the value the target gives it, or
        # unset again) is the same drafter; one that resolves otherwise under the same config
        # (a mask token picked anew) is another, which the config lines alone missed
        same = [k for k in shape if saved_shape.get(k) == shape[k]]
        fixed = [line for line in fixed if line.split(":")[0] not in {f"drafter.{k}" for k in same}]
        named = {line.split(":")[0] for line in fixed}
        for key in shape:
            if key not in same and f"drafter.{key}" not in named and key != "num_tapped":
                fixed.append(f"the drafter's {key}: {saved_shape.get(key)!r} -> {shape[key]!r}")
    if meta.get("store_content_key") != store_key:
        fixed.append("data.store: its content key differs (another extraction)")
    if meta.get("world_size", world) != world:
        fixed.append(f"world size: {meta['world_size']} -> {world} processes")
    saved_layers = meta.get("target", {}).get("tapped_layers")
    if layers is not None and saved_layers == layers:
        # data.tapped_layers matters by the layers it reads: naming all of the store's layers,
        # or leaving it unset (all of them), is the same drafter input, not a change
        fixed = [line for line in fixed if not line.startswith("data.tapped_layers:")]
    if layers is not None and saved_layers is not None and saved_layers != layers:
        # the same config can read other layers: a store an earlier release wrote out of
        # ascending order is now read reordered, and the checkpoint's fc expects the old order
        fixed.append(f"the drafter's tapped layers: {saved_layers} -> {layers}")
    if fixed:
        raise ValueError(
            f"{path} was trained with other settings, which a resume cannot change: "
            f"{'; '.join(fixed)}; resume with the checkpoint's values and devices, or pass a "
            "new --out"
        )
    if changeable and not allow_change:
        raise ValueError(
            f"{path} was trained with other settings: {'; '.join(changeable)}; rerun with "
            "--allow-config-change to apply them from this step on, or with the checkpoint's "
            "values"
        )
    return changeable


def apply_optim_config(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: OptimConfig,
) -> None:
    """Make a restored optimizer and schedule follow `cfg`: a restored state carries the old
    peak lr, betas and weight decay (the schedule's shape is its lambda, built from `cfg`)."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update(
            initial_lr=cfg.lr,
            betas=(cfg.betas[0], cfg.betas[1]),
            weight_decay=cfg.weight_decay if group.get("decay", True) else 0.0,
        )
    refresh_lr(scheduler)  # each group's lr: the new peak times the schedule's factor now


def resume_run(
    cfg: TrainConfig,
    world: int,
    store_key: str,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    rank: int,
    device: torch.device,
    layers: list[int] | None = None,
    shape: dict[str, Any] | None = None,
    plan: EpochPlan | FollowPlan | None = None,
) -> tuple[TrainState, FittedEnd | None] | None:
    """Resume from the newest readable checkpoint of `cfg.run.out`: its train state and the
    schedule's end it had fitted to a time limit (time_fit.restore_fitted puts it back in
    force); None: a fresh run. First removes what a killed run left (remove_leftovers).
    `plan`: this run's data plan, whose order an unfinished epoch 0 must keep."""
    current = dataclasses.asdict(cfg)
    changes: list[str] = []

    def check(meta: dict[str, Any], path: Path) -> None:
        nonlocal changes
        if plan is not None:
            # first: an unfinished epoch 0 resumed with --follow switched (data.follow) is
            # refused as such, not after asking for --allow-config-change, nor after logging
            # that change as applied
            check_stream_position(saved_train_state(meta), plan)
        changes = check_same_run(
            meta, current, world, path, store_key, cfg.run.allow_config_change, layers, shape
        )

    remove_leftovers(cfg.run.out, rank)  # before any rank lists the checkpoints
    resumed = resume_latest(
        cfg.run.out,
        check,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        rank=rank,
        device=device,
    )
    if resumed is None:
        return None
    state, meta, path = resumed
    log = get_logger()
    if changes:
        apply_optim_config(optimizer, scheduler, cfg.optim)
        for line in changes:
            log.info("resume: config change applied from step %d: %s", state.step, line)
    log.info("resumed from %s (step %d, epoch %d)", path, state.step, state.epoch)
    return state, fitted_end(meta["train_state"])


def say_nothing_to_train(out: str | Path, step: int, last: int) -> None:
    """Log what a run resumed at `step`, at or past its `last` step, does: it trains nothing
    and exports the resumed drafter to RUN/export. Past it (optim.max_steps or optim.epochs
    lowered with --allow-config-change), that drafter is step `step`'s, not step `last`'s: the
    steps past the new end are not undone, so the warning names the kept checkpoints to
    export instead."""
    log = get_logger()
    if step == last:
        log.info("the run is complete at step %d: nothing to train; exporting it again", step)
        return
    kept = [int(STEP_RE.match(p.name).group(1)) for p in list_checkpoints(out)]
    kept = [n for n in kept if n <= last]
    earlier = (
        f"`dflash export {out} --step {kept[-1]} --out FOLDER` exports the newest kept one "
        f"up to it (kept: {', '.join(map(str, kept))})"
        if kept
        else f"no checkpoint up to step {last} is kept"
    )
    log.warning(
        "nothing to train: resumed at step %d, past the run's last step %d (optim.max_steps / "
        "optim.epochs as now set); the steps past it are not undone: %s/export gets step %d's "
        "drafter, as it is; %s",
        step,
        last,
        out,
        step,
        earlier,
    )
