"""Optimizer and learning-rate schedule of `dflash train`: AdamW, linear warmup, then a cosine
decay (`optim.schedule=cosine`) or warmup-stable-decay (`wsd`: the peak lr until the last
`optim.decay_ratio` of the steps, then a 1 - sqrt decay to the floor, the cooldown shape that
matched cosine's final loss in Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
Beyond Fixed Training Durations"). Why wsd: on pystd the dev acceptance rose most in cosine's
low-lr tail (BENCHMARKS.md, eleventh session); wsd gives that tail a set share of the steps.
Under `run.time_limit_s` the end may be moved earlier, to the last step the limit leaves
room for (`ScheduleEnd`, stage2_train/time_fit.py), so a stopped run ends annealed: wsd's decay
once (planned to the new end, or, already decaying, the rest of it re-mapped onto the steps
left), cosine's remaining decay re-mapped onto the steps left.

Numerics: parameters live in the parameter dtype of `run.dtype`, and AdamW's moment buffers
take the parameters' dtype. `mixed` (the default) keeps fp32 master weights and fp32 AdamW
states with bf16 matmuls under autocast (+8 bytes per parameter over `bfloat16`: ~8 GB for a
Qwen3-8B-size drafter). With `bfloat16` parameters the fused kernel rounds each update once
when storing, and an update smaller than half a bf16 ulp of its weight (2^-9 of it, 0.2-0.4%)
vanishes: the RMSNorm weights (~1.0, half-ulp 0.004) never move at the paper's lr 6e-4, and
the linear weights stop moving in the cosine tail. `float32` keeps everything in fp32 (the CPU
tests use it, for exact resume comparisons).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from stage2_train.config import OptimConfig


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """AdamW's groups: the matrices decay by `weight_decay`, the vectors (RMSNorm weights)
    never: decaying a norm's gain toward 0 fights its purpose (the usual exclusion). Each
    group's `decay` flag says which it is; an empty group is left out."""
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups = [
        {"params": matrices, "weight_decay": weight_decay, "decay": True},
        {"params": vectors, "weight_decay": 0.0, "decay": False},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over `params` (`param_groups`); the fused kernel on CUDA, foreach elsewhere."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(params, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )


@dataclass(frozen=True)
class FittedEnd:
    """A schedule shortened to a time limit (1-based steps, as metrics.jsonl counts them): the
    floor at step `end`, a new curve from step `decay_from` on, under optim.schedule
    `schedule` (the decay `progress` is a share of). With a `progress` (cosine always, wsd
    when fitted already decaying): from step `decay_from` - 1, where the decay's progress was
    `progress`, the progress runs linearly to 1 at `end`; the steps before keep the configured
    curve. wsd without one (fitted before its decay began): the peak lr until step
    `decay_from` - 1, then its decay."""

    end: int
    decay_from: int
    progress: float | None = None
    # keyword-only and required: a progress alone does not say which decay it is a share of
    schedule: str = field(kw_only=True)


@dataclass
class ScheduleEnd:
    """Where the decay ends, as the lr lambda reads it at every step: `fitted` None is the
    configured end (optim.max_steps or the epochs). Mutable because LambdaLR keeps the lambda
    it was built with, and a resume rebuilds that lambda from the config (time_fit.py)."""

    fitted: FittedEnd | None = None


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return math.ceil(warmup_ratio * total_steps)


def wsd_decay_steps(end: int, warmup: int, decay_ratio: float) -> int:
    """Steps of the wsd decay of a run ending at step `end`: `decay_ratio` of its post-warmup
    steps, at least one."""
    return max(math.ceil(decay_ratio * (end - warmup)), 1)


def lr_factor(
    step: int,
    total_steps: int,
    warmup_ratio: float,
    min_lr_ratio: float,
    schedule: str = "cosine",
    decay_ratio: float = 0.2,
    fitted: FittedEnd | None = None,
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based) of `total_steps`; `fitted`
    moves the decay to end earlier, keeping the warmup of `total_steps`."""
    warmup = warmup_steps(total_steps, warmup_ratio)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        progress = wsd_progress(step, total_steps, warmup, decay_ratio, fitted)
        if progress == 0.0:
            return 1.0  # the stable phase: the peak, exactly
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - math.sqrt(progress))
    progress = cosine_progress(step, total_steps, warmup, fitted)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def remapped_progress(step: int, fitted: FittedEnd) -> float | None:
    """The decay's progress at optimizer step `step` (0-based) on the curve `fitted` (one with
    a progress) re-maps, or None before its anchor, step `decay_from` - 1 (1-based), where the
    configured curve holds."""
    anchor = fitted.decay_from - 1
    if step + 1 < anchor:
        return None
    # linear in the step from the progress at the anchor: the lr is continuous there and falls
    # at a constant pace in progress, as the configured decay does, to the floor
    span = fitted.end - anchor
    share = (step + 1 - anchor) / span if span > 0 else 1.0  # no steps left: the floor
    return min(fitted.progress + share * (1.0 - fitted.progress), 1.0)


def wsd_progress(
    step: int, total_steps: int, warmup: int, decay_ratio: float, fitted: FittedEnd | None
) -> float:
    """Share of the wsd decay done after optimizer step `step` (0-based, past the `warmup`
    steps): 0 in the stable phase, 1 at the last step, configured or fitted."""
    if fitted is not None and fitted.progress is not None:
        if (remapped := remapped_progress(step, fitted)) is not None:
            return remapped
        fitted = None  # before the anchor: the configured decay
    if fitted is None:
        end = total_steps
        stable_end = end - wsd_decay_steps(end, warmup, decay_ratio)
    else:  # frozen before the decay began (and any wsd fit of an earlier release)
        end, stable_end = fitted.end, fitted.decay_from - 1
    if step < stable_end:
        return 0.0
    # reaches the floor at the last step (a decay of no steps: at the floor; checkpoints of an
    # earlier release could record one)
    span = end - stable_end
    return min((step - stable_end + 1) / span, 1.0) if span > 0 else 1.0


def cosine_progress(step: int, total_steps: int, warmup: int, fitted: FittedEnd | None) -> float:
    """Share of the cosine decay done at optimizer step `step` (0-based, past the `warmup`
    steps): 1 at step `total_steps` (one past the last), or, fitted, at the last step."""
    if fitted is not None and (remapped := remapped_progress(step, fitted)) is not None:
        return remapped
    span = max(total_steps - warmup, 1)
    return min((step - warmup) / span, 1.0)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
    end: ScheduleEnd | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr schedule of `cfg` over `total_steps`; the decay ends where `end` says when it
    holds a fitted end (read at every step)."""
    end = end or ScheduleEnd()
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            total_steps,
            cfg.warmup_ratio,
            cfg.min_lr_ratio,
            cfg.schedule,
            cfg.decay_ratio,
            end.fitted,
        ),
    )


def refresh_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set the next step's lr from the lambdas as they read now: LambdaLR computed it at its
    last step(), before its base lr or its end moved (the same expression as LambdaLR.get_lr)."""
    groups = scheduler.optimizer.param_groups
    factors = zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    for group, base, factor in factors:
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]
