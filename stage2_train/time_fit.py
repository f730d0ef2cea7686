"""Fitting the lr schedule to `run.time_limit_s`, so a run the limit cuts short still ends
annealed (`optim.fit_time_limit`, on by default), under wsd and cosine alike.

Without it, a run the limit stops mid-schedule is exported at a high lr, unannealed: on pystd a
cosine run stopped at step 4,387 of 7,500 still trained at 8.5e-4 of 2e-3, and lost acceptance
to it. With it, after every step the trainer projects the last step it will finish before the
limit: the seconds left (less `SAFETY` of them) over its seconds per step. That rate is the
wall time between steps, so evaluations, checkpoints and loader waits count in it, taken as the
larger of the mean since the first `WARM_STEPS` steps of the job (they compile) and the median
of the last `WINDOW` steps (a sustained slowdown, which a mean is slow to show; a median
ignores the isolated evaluation). That window is 300 steps (fewer until that many are
measured), so a slowdown counts once it has lasted 150. At 50 the loader's noise moved it too
much: on an H200 (pystd, cosine, 9,025 steps in ~880 s, steps of 0.083-0.110 s) runs of ~100
slow steps took the median from 0.095 to 0.110 s/step and back, and the fit made ~80
decisions, seven shortenings within 4 s, then lengthenings. When the projected end E is
before the schedule's end, the schedule is shortened to end at E (`FittedEnd`, the runner's
`ScheduleEnd.fitted`): logged, recorded in the step's metrics line (`schedule_end`,
`decay_from`) and in every later checkpoint (`fit_end` of its train_state), and the run stops
at E, annealed; a resumed run continues the same curve, with or without a limit.

- wsd: the decay is planned over `optim.decay_ratio` of the post-warmup steps to E, and E is
  frozen when that decay is due to start; it never moves after that (a decay re-planned would
  jump). Had the limit come before E after all, it stops the run as before, mid-decay. A
  projection that first falls short once the configured decay has begun (the run slowed down
  late) re-maps the rest of that decay as cosine's below: from the step just run, k, at
  progress p of the 1 - sqrt decay, the progress at step s is p + (s - k) / (E - k) * (1 - p),
  and E is frozen the same way. Keeping the decay's start and only moving its end, as before,
  shrank at once the span the progress is a share of: the lr fell at step k + 1 by ~8 steps'
  worth (a 3x slowdown from step 700 of 1,000, fitted at step 850 to end at 972).
- cosine decays from the warmup on, so it is fitted at the first projection that falls short
  (the first comes after `MIN_STEPS` measured steps, and not before the warmup's last step:
  the warmup runs as configured whatever is decided, and its steps measure the rate better
  than the first 20): from the step just run, k, where its progress (the share of the decay
  done) was p, the rest of the cosine is re-mapped onto the steps to E: the progress at step
  s is p + (s - k) / (E - k) * (1 - p), continuous at k and 1 (the floor) at E. Decided at
  the warmup's last step, the re-mapped cosine starts at its first step (p = 0, the peak); a
  limit that ends the run inside the warmup fits nothing (it stops unannealed, as it would at
  any fitted end past it). A later projection that falls
  short of E by more than `REFIT_MARGIN` of the steps left re-maps again, the same way from
  the step just run (the lr stays continuous and never rises, whichever way E moves); one
  short by less is the rate's noise. E also moves later, up to the configured end, when a
  projection passes it by more than `LENGTHEN_MARGIN` of the steps left within the first third
  of the fitted decay: the first projection comes early, when the steps still include the
  loader's start and the first compilations, and a pessimistic one would otherwise cost its
  steps for good. (Not later in the decay: the time held back, `SAFETY` of what is left,
  shrinks as the run goes on, so a steady run's projections creep past E near its end.)
  After a re-map the next waits `COOLDOWN` of the run's steps (5%: ~450 at pystd's 9,000, so at
  most 20 such re-maps a run) unless the projection falls short by more than `URGENT_MARGIN` of
  the steps left (10%, past the 300-step median's noise): a real slowdown re-maps at once. 5%
  still lets a first fit three times too short (E at 30% of the run) lengthen in the first
  third of its decay. A replayed trace like the H200's (tests/test_time_fit.py) makes 6
  decisions, where a 50-step window and no cooldown made 34; a step time that doubles re-maps
  within 150 steps. A projection with no step left (one slow step carried the clock past the
  limit) fits nothing: the limit then stops the run as interrupted, resumable.
  The price: a slowdown in the last ~150 steps shows too late, and the limit stops the run in
  the last ~2% of its decay, where the cosine is ~0.1% of the peak above its floor.

With several ranks the ranks agree on E (the earliest any of them proposes, one all-reduce
per step while the fit may still move, read a step late like the stop agreement), so their
lrs stay identical.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from time import monotonic  # a module name, so that tests replace the clock

import torch
import torch.distributed as dist

from common.logging import get_logger
from stage2_train.config import OptimConfig
from stage2_train.host_copy import HostCopy
from stage2_train.schedule import (
    FittedEnd,
    ScheduleEnd,
    cosine_progress,
    refresh_lr,
    warmup_steps,
    wsd_decay_steps,
    wsd_progress,
)

WARM_STEPS = 10  # steps of each job left unmeasured: the first ones compile (~10 s on a GPU)
MIN_STEPS = 20  # measured steps before the first projection
WINDOW = 300  # recent steps whose median step time catches a sustained slowdown
SAFETY = 0.02  # share of the remaining time left unplanned, for the rate's noise
REFIT_MARGIN = 0.02  # cosine: share of the steps left a projection must fall short by
LENGTHEN_MARGIN = 0.05  # cosine: ... or pass it by, early in the fitted decay
URGENT_MARGIN = 0.10  # cosine: ... fall short by to re-map within the cooldown
COOLDOWN = 0.05  # cosine: share of the run's steps from a re-map to the next (not urgent)
NO_PROPOSAL = 2**62  # a rank with nothing to propose (the ranks agree on the minimum)
ANNEALED = 1e-3  # the next step's lr within this share of the way from the floor to optim.lr:
# the fitted decay is over

log = get_logger()


class StepRate:
    """Seconds per step, from the wall clock at the end of each step."""

    def __init__(self, window: int = WINDOW) -> None:
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, step: int, now: float) -> None:
        if self.last is None:
            self.first = (step, now)
        else:
            self.recent.append((now - self.last[1]) / (step - self.last[0]))
        self.last = (step, now)

    @property
    def steps(self) -> int:
        """Steps measured so far."""
        return 0 if self.last is None else self.last[0] - self.first[0]

    def seconds_per_step(self) -> float:
        mean = (self.last[1] - self.first[1]) / self.steps
        return max(mean, statistics.median(self.recent))


def projected_end(step: int, seconds_left: float, seconds_per_step: float) -> int:
    """The last step finished before the limit, after step `step`, at this rate."""
    return step + math.floor(max(seconds_left, 0.0) * (1.0 - SAFETY) / seconds_per_step)


def decay_from(end: int, total_steps: int, cfg: OptimConfig) -> int:
    """The first decayed step of a wsd run ending at `end` (the warmup stays total_steps')."""
    warmup = warmup_steps(total_steps, cfg.warmup_ratio)
    return end - wsd_decay_steps(end, warmup, cfg.decay_ratio) + 1


def freeze_due(step: int, projected: int, total_steps: int, cfg: OptimConfig) -> bool:
    """After step `step`: the run, projected to end at `projected`, should decay from the next
    step on (a projection at or past total_steps changes nothing)."""
    return projected < total_steps and decay_from(projected, total_steps, cfg) <= step + 1


def frozen_end(step: int, projected: int, total_steps: int, cfg: OptimConfig) -> FittedEnd:
    """The shortened schedule, frozen after step `step`: decay from the next step (not before
    the warmup's end), ending at `projected`. Already decaying toward total_steps (step `step`
    was on the configured decay), the rest of the decay is re-mapped from that step's progress
    onto the steps to `projected`: continuous at `step`, never rising, the floor at the end."""
    warmup = warmup_steps(total_steps, cfg.warmup_ratio)
    if step >= decay_from(total_steps, total_steps, cfg):
        progress = wsd_progress(step - 1, total_steps, warmup, cfg.decay_ratio, None)
        end = max(projected, step + 1)
        return FittedEnd(end=end, decay_from=step + 1, progress=progress, schedule="wsd")
    first = max(decay_from(projected, total_steps, cfg), step + 1, warmup + 1)
    return FittedEnd(end=max(projected, first), decay_from=first, schedule="wsd")


def refitted_cosine(
    step: int,
    projected: int,
    total_steps: int,
    cfg: OptimConfig,
    current: FittedEnd | None,
) -> FittedEnd | None:
    """The cosine re-mapped after step `step` to end at `projected` (from `current`, the curve
    in force: None is the configured one), or None when that is not far enough from the end in
    force: the first fit whenever it is sooner, from the warmup's last step on, a later one
    when sooner by more than
    REFIT_MARGIN of the steps left (the rate's noise re-maps nothing), or later by more than
    LENGTHEN_MARGIN of them in the first third of the fitted decay; either only COOLDOWN of
    total_steps after the last re-map (its anchor), unless sooner by more than URGENT_MARGIN
    of the steps left. The end never passes `total_steps`: the configured end (a resumed
    fitted run passes its fitted end, so a resumed job only shortens; the loader's sampler was
    sized to it). The fitted curve covers every step from its anchor on, and the anchor only
    moves later."""
    warmup = warmup_steps(total_steps, cfg.warmup_ratio)
    if current is None:
        if step < warmup:
            # the warmup runs as configured whatever is decided, so the first fit waits for its
            # last step and a rate measured over the warmup rather than over its first
            # MIN_STEPS steps (pystd, 640 warmup steps: fitted at step 30 from 0.116 s/step
            # against the 0.087 that followed, lengthened only at step 1,441)
            return None
        end = total_steps
        anchor = max(step, warmup + 1)  # the cosine's first step
    else:
        end, anchor = current.end, max(step, current.decay_from - 1)
    # a step at least, past the limit if need be; never past the configured end
    fitted_end = min(max(projected, anchor + 1), total_steps)
    if current is None:
        due = fitted_end < end
    else:
        left, since = end - step, current.decay_from - 1
        early = 3 * (step - since) < end - since
        cooled = step - since >= COOLDOWN * total_steps
        shorter = fitted_end < end - REFIT_MARGIN * left
        longer = early and fitted_end > end + LENGTHEN_MARGIN * left
        due = fitted_end < end - URGENT_MARGIN * left or (cooled and (shorter or longer))
    if not due:
        return None
    progress = cosine_progress(anchor - 1, total_steps, warmup, current)
    return FittedEnd(end=fitted_end, decay_from=anchor + 1, progress=progress, schedule="cosine")


def describe(fitted: FittedEnd) -> str:
    """Where the fitted curve starts, for the log."""
    if fitted.progress is None:
        return f"decay from step {fitted.decay_from}"
    decay = "cosine" if fitted.schedule == "cosine" else "wsd decay"
    return (
        f"{decay} re-mapped from step {fitted.decay_from} on (progress {fitted.progress:.4f} "
        f"at step {fitted.decay_from - 1})"
    )


class TimeFit:
    """Watches the step rate and moves the schedule's end (see the module docstring); inactive
    (observe() returns None at once) without a time limit or optim.fit_time_limit, and under
    wsd once an end is fitted. Built where the time limit starts counting (beside
    StopRequests); `total_steps` is the run's end as the trainer has it."""

    def __init__(
        self,
        cfg: OptimConfig,
        time_limit_s: float | None,
        total_steps: int,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        end: ScheduleEnd,
        *,
        first_step: int,
        device: torch.device,
        world_size: int,
    ) -> None:
        self.cfg, self.total_steps, self.scheduler, self.end = cfg, total_steps, scheduler, end
        self.device, self.world_size = device, world_size
        self.active = (
            cfg.fit_time_limit
            and time_limit_s is not None
            and not (cfg.schedule == "wsd" and end.fitted is not None)
        )
        # the limit counts from here, as StopRequests' does (built beside it)
        self.deadline = monotonic() + time_limit_s if self.active else math.inf
        self.measure_from = first_step + WARM_STEPS
        self.rate = StepRate()
        self._agreed: HostCopy | None = None  # several ranks: the last call's agreement

    def restart_measuring(self, step: int) -> None:
        """Measure the rate afresh from step `step` on (alike on every rank: called at the
        same step). `dflash train --follow` calls it when its streamed first epoch ends: those
        steps shared the GPU with extract and waited for its shards, and the mean since the
        first step would carry their slower pace into every later projection (a 1,100-s run,
        667 steps at 0.15 s then 0.086: eight re-maps and 0.93x the mean lr, where measuring
        afresh makes three; tests/test_time_fit.py replays it).
        The fit still acts during that epoch, so a limit shorter than extraction anneals."""
        self.measure_from = step + WARM_STEPS
        self.rate = StepRate()

    def plan(self, step: int, projected: int) -> FittedEnd | None:
        """The end to move to after step `step`, the run projected to end at `projected`; None
        when nothing is due."""
        if self.cfg.schedule == "wsd":
            if not freeze_due(step, projected, self.total_steps, self.cfg):
                return None
            return frozen_end(step, projected, self.total_steps, self.cfg)
        return refitted_cosine(step, projected, self.total_steps, self.cfg, self.end.fitted)

    def observe(self, step: int) -> FittedEnd | None:
        """After step `step`, before the next is queued: the end, when moved now (the lambda
        and the next step's lr already follow it), else None. Every rank calls it every step."""
        if not self.active or step < self.measure_from:
            return None
        now = monotonic()
        self.rate.add(step, now)
        proposed = NO_PROPOSAL
        if self.rate.steps >= MIN_STEPS:
            seconds_left = self.deadline - now
            projected = projected_end(step, seconds_left, self.rate.seconds_per_step())
            # a projection with no step left (a slow step, an evaluation, carried the clock to
            # the limit) has nothing to anneal in: the limit stops the run as interrupted,
            # resumable, not "finished" at the lr it trained at
            if projected > step and self.plan(step, projected) is not None:
                proposed = projected
        agreed = self._agree(proposed)
        # planned again from the agreed end, alike on every rank: a proposal read a step late
        # and made stale by a move in between plans nothing (one rank: the plan above)
        fitted = self.plan(step, agreed) if agreed != NO_PROPOSAL else None
        if fitted is None:
            return None
        was = self.end.fitted.end if self.end.fitted is not None else self.total_steps
        self.end.fitted = fitted
        refresh_lr(self.scheduler)
        self.active = self.cfg.schedule != "wsd"  # a wsd decay, once begun, stays
        log.info(
            "time limit: schedule %s to end at step %d, %s (was step %d; %.3f s/step, "
            "%.0f s left of run.time_limit_s; optim.fit_time_limit)",
            "lengthened" if fitted.end > was else "shortened",
            fitted.end,
            describe(fitted),
            was,
            self.rate.seconds_per_step(),
            self.deadline - now,
        )
        return fitted

    def finish_at_limit(self, step: int) -> bool:
        """Called when the time limit stops the run after step `step`: True when the fitted
        decay is over (it began by `step`, and the next step's lr is within ANNEALED of the way
        from the floor to optim.lr; the limit came a step or so before the planned end, as the
        last evaluations take longer than the rate the fit planned with), and the schedule then
        ends at `step`: the run is finished, not interrupted, and a rerun finds nothing left to
        train. A limit that one slow step carried the clock past, at a high lr, is an
        interruption (observe fits nothing with no step left). Alike on every rank (the lr is)."""
        fitted = self.end.fitted
        # "annealed" is near the schedule's floor, whatever optim.min_lr_ratio puts it at
        floor = self.cfg.min_lr_ratio
        annealed = self.cfg.lr * (floor + ANNEALED * (1.0 - floor))
        # and the decay began by the step just trained (a fit decided past the limit would
        # put its whole decay after it)
        if fitted is None or fitted.decay_from > step or self.scheduler.get_last_lr()[0] > annealed:
            return False
        self.end.fitted = dataclasses.replace(fitted, end=step)
        return True

    def _agree(self, proposed: int) -> int:
        """The earliest end any rank proposed, as agreed at the previous call (the ranks'
        clocks differ; their lrs must not): one all-reduce, read a step late so the host does
        not wait for the step's kernels. One rank: its own proposal, at once."""
        if self.world_size == 1 or not dist.is_initialized():
            return proposed
        value = torch.full((1,), proposed, dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        previous, self._agreed = self._agreed, HostCopy(value)
        return int(previous.read().item()) if previous is not None else NO_PROPOSAL


def restore_fitted(
    fitted: FittedEnd | None,
    end: ScheduleEnd,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: OptimConfig,
    total_steps: int,
) -> int:
    """Put a resumed run's fitted end back in force (`fitted`, its checkpoint's) and return
    the run's last step: the fitted end, or total_steps when sooner (a config change).
    Dropped, with a log line, when the resumed config no longer fits its schedule to a limit
    (another optim.schedule: the fitted curve is a share of the other decay)."""
    if fitted is None:
        return total_steps
    fitted_for = fitted.schedule
    if cfg.schedule != fitted_for or not cfg.fit_time_limit:
        log.info(
            "resume: the schedule's end at step %d, fitted to a time limit under %s, is "
            "dropped (optim.schedule=%s, optim.fit_time_limit=%s)",
            fitted.end,
            fitted_for,
            cfg.schedule,
            cfg.fit_time_limit,
        )
        refresh_lr(scheduler)  # as loaded, the lr followed the fitted end; checkpoints drop it
        return total_steps
    end.fitted = fitted
    refresh_lr(scheduler)  # as saved; a config change applied on resume computed it without
    log.info(
        "time limit: schedule ends at step %d, %s (fitted before this resume)",
        fitted.end,
        describe(fitted),
    )
    return min(total_steps, fitted.end)
