"""optim.fit_time_limit: under run.time_limit_s a run projects the last step it can finish
and, when that comes before its end, stops there annealed: wsd decays to it (frozen once),
cosine re-maps the rest of its decay onto the steps left (again when a slowdown shortens it);
checkpoints carry the decisions. The clock is a fake one (no timing)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from store_factory import FactorySpec, build_store

from common.config import build_config
from common.errors import Stopped
from stage2_train import stop as stop_module
from stage2_train import time_fit
from stage2_train.config import OptimConfig, TrainConfig
from stage2_train.schedule import (
    FittedEnd,
    ScheduleEnd,
    build_optimizer,
    build_scheduler,
    lr_factor,
    refresh_lr,
)
from stage2_train.time_fit import TimeFit
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
WSD = OptimConfig(lr=0.1, schedule="wsd", warmup_ratio=0.04, decay_ratio=0.2, min_lr_ratio=0.1)
# a 10-step warmup at 1000 steps: the rate is known (step 30) after it
COSINE = OptimConfig(lr=0.1, schedule="cosine", warmup_ratio=0.01, min_lr_ratio=0.1)


class FakeClock:
    """monotonic() for time_fit: `now` seconds, moved by the test (or by `tick` per call)."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def old_lr_factor(step, total, warmup_ratio, min_lr_ratio, schedule="cosine", decay_ratio=0.2):
    """lr_factor before the fitted end existed, verbatim: the no-limit reference."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay = max(math.ceil(decay_ratio * (total - warmup)), 1)
        stable_end = total - decay
        if step < stable_end:
            return 1.0
        progress = min((step - stable_end + 1) / decay, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - math.sqrt(progress))
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def shape(cfg: OptimConfig) -> tuple[float, float, str, float]:
    """old_lr_factor's arguments after the step and the total."""
    return cfg.warmup_ratio, cfg.min_lr_ratio, cfg.schedule, cfg.decay_ratio


@contextmanager
def group_of_one() -> Iterator[None]:
    """A gloo process group of one rank, standing in for several (the fit's agreement path)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fitted_run(
    clock: FakeClock,
    cfg: OptimConfig,
    total: int,
    limit: float | None,
    s_per_step: float | Callable[[int], float],
    world: int = 1,
    restart_at: int | None = None,
) -> tuple[list[float], TimeFit, dict[int, FittedEnd]]:
    """Scheduler steps (no model) to the end, the clock moving `s_per_step` a step (or
    `s_per_step(step)`): the lr of every step (1-based step = list index + 1), the planner, and
    what observe() returned, by step; `restart_at`: the step after which the rate is measured
    afresh (as --follow's streamed epoch ends)."""
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(list(model.parameters()), cfg, torch.device("cpu"))
    end = ScheduleEnd()
    scheduler = build_scheduler(optimizer, cfg, total, end)
    fit = TimeFit(
        cfg,
        limit,
        total,
        scheduler,
        end,
        first_step=0,
        device=torch.device("cpu"),
        world_size=world,
    )
    lrs, frozen = [], {}
    for step in range(1, total + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        clock.now += s_per_step(step) if callable(s_per_step) else s_per_step
        if (fitted := fit.observe(step)) is not None:
            frozen[step] = fitted
            total = fitted.end
        if step == restart_at:
            fit.restart_measuring(step)
        if step == total:
            break
    return lrs, fit, frozen


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time_fit, "monotonic", fake)
    return fake


def test_the_end_is_frozen_when_the_shortened_decay_is_due(clock: FakeClock) -> None:
    # 1 s a step and 600 s for 1000 steps: about 588 steps fit (2% of the time kept back)
    lrs, fit, frozen = fitted_run(clock, WSD, 1000, limit=600.0, s_per_step=1.0)
    [(step, fitted)] = frozen.items()
    assert 560 < fitted.end < 600 and fitted.decay_from == step + 1
    warmup = math.ceil(0.04 * 1000)
    decay = fitted.end - fitted.decay_from + 1
    assert decay == math.ceil(0.2 * (fitted.end - warmup))  # decay_ratio of the fitted run
    assert len(lrs) == fitted.end  # the run stops at the fitted end
    assert lrs[:step] == [0.1 * old_lr_factor(s, 1000, 0.04, 0.1, "wsd") for s in range(step)]
    assert all(a > b for a, b in zip(lrs[step - 1 :], lrs[step:], strict=False))  # decaying
    assert lrs[-1] == pytest.approx(0.1 * 0.1, rel=1e-12)  # the floor at the end step
    assert lr_factor(fitted.end - 1, 1000, 0.04, 0.1, "wsd", 0.2, fitted) == 0.1
    assert not fit.active and fit.observe(step + 1) is None  # never moved again


def slower_late(step: int) -> float:
    """Seconds per step: 1, then 3 from step 701 of 1,000 (wsd's decay: steps 809-1,000)."""
    return 1.0 if step <= 700 else 3.0


def wsd_slope(step: int, progress: float, end: int, cfg: OptimConfig) -> float:
    """The lr's fall per step at step `step` of a wsd decay at `progress` there, re-mapped to
    end at step `end`: d/ds of lr (1 - sqrt(p + (s - k) / (E - k) * (1 - p))) at s = k. The
    1 - sqrt decay falls ever slower, so no later step falls by more."""
    per_step = (1.0 - progress) / (end - step)
    return cfg.lr * (1.0 - cfg.min_lr_ratio) * per_step / (2.0 * math.sqrt(progress))


def test_a_late_shortening_remaps_the_rest_of_the_wsd_decay(clock: FakeClock) -> None:
    """3x slower from step 700 of 1,000: the projection falls short only at step 850, inside
    the configured decay (steps 809-1,000). The rest of the 1 - sqrt decay is re-mapped from
    step 850's progress onto the steps to the new end: the lr goes on from where it was, no
    step falls by more than the re-mapped decay's slope (keeping the decay's start and moving
    its end fell ~8 steps' worth at step 851), the floor at the end, and it never moves
    again. A sudden 200x slowdown mid-decay re-maps the same way."""
    lrs, fit, frozen = fitted_run(clock, WSD, 1000, 1400.0, slower_late)
    [(step, fitted)] = frozen.items()
    p = (step - 808) / 192  # the configured decay's progress at `step`
    drops = [a - b for a, b in zip(lrs[step - 1 :], lrs[step:], strict=False)]
    slope = wsd_slope(step, p, fitted.end, WSD)
    assert 0 < max(drops) <= slope, (step, drops[:3], slope)
    assert_no_jump(lrs, step)
    assert_annealed(lrs, WSD, 1000)  # never rising, the floor exactly at the fitted end
    assert len(lrs) == fitted.end and not fit.active and fit.observe(step + 1) is None
    assert step == 850 and fitted == FittedEnd(972, 851, p, schedule="wsd")
    reference = [0.1 * old_lr_factor(s, 1000, *shape(WSD)) for s in range(1000)]
    assert lrs[:step] == reference[:step]
    assert factor(step, WSD, 1000, fitted) == reference[step - 1] / 0.1  # continuous at it

    clock.now = 0.0
    # configured decay: steps 81-100
    lrs, _, frozen = fitted_run(clock, WSD, 100, 1000.0, lambda s: 1.0 if s < 85 else 200.0)
    [(step, fitted)] = frozen.items()
    assert 81 <= step < fitted.end < 100
    assert lrs[:step] == [0.1 * old_lr_factor(s, 100, *shape(WSD)) for s in range(step)]
    drops = [a - b for a, b in zip(lrs[step - 1 :], lrs[step:], strict=False)]
    assert 0 < max(drops) <= wsd_slope(step, (step - 80) / 20, fitted.end, WSD)
    assert_annealed(lrs, WSD, 100)


def test_several_ranks_remap_a_late_wsd_decay_one_step_late(clock: FakeClock) -> None:
    """The agreed end, read a step late, re-maps from the step it is read at: the progress
    there, the same end, the lr continuous."""
    _, _, alone = fitted_run(clock, WSD, 1000, 1400.0, slower_late)
    [(step, fitted)] = alone.items()
    clock.now = 0.0
    with group_of_one():
        lrs, _, agreed = fitted_run(clock, WSD, 1000, 1400.0, slower_late, world=2)
    p = (step + 1 - 808) / 192
    assert agreed == {step + 1: FittedEnd(fitted.end, step + 2, p, schedule="wsd")}
    assert factor(step + 1, WSD, 1000, agreed[step + 1]) == factor(step + 1, WSD, 1000, None)
    assert_no_jump(lrs, step + 1)
    assert_annealed(lrs, WSD, 1000) and len(lrs) == fitted.end


def test_without_a_limit_the_schedule_is_the_same_as_before(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_clock() -> float:
        raise AssertionError("the clock was read without a time limit")

    monkeypatch.setattr(time_fit, "monotonic", no_clock)
    for schedule in ("cosine", "wsd"):
        cfg = OptimConfig(lr=0.1, schedule=schedule, min_lr_ratio=0.05, decay_ratio=0.3)
        lrs, fit, frozen = fitted_run(clock, cfg, 200, limit=None, s_per_step=1.0)
        assert not fit.active and frozen == {}
        assert lrs == [0.1 * old_lr_factor(s, 200, 0.04, 0.05, schedule, 0.3) for s in range(200)]
    cases = [(0.1, 0.1), (0.04, 0.0, "cosine", 0.2), (0.0, 0.3, "cosine", 0.5)]
    cases += [(0.04, 0.0, "wsd", 1 / 3), (0.0, 0.2, "wsd", 1.0)]
    for total in (1, 7, 100, 1001):  # the bare factor too, exactly
        for step in range(0, total + 2, max(total // 50, 1)):
            for args in cases:
                assert lr_factor(step, total, *args) == old_lr_factor(step, total, *args)
                assert lr_factor(step, total, *args, None) == old_lr_factor(step, total, *args)


@pytest.mark.parametrize("schedule", ["wsd", "cosine"])
def test_a_step_that_carries_the_clock_past_the_limit_fits_nothing(
    clock: FakeClock, schedule: str
) -> None:
    """One slow step (an evaluation) at peak lr carries the clock past the limit: no fit is
    made with no step left to anneal in, so the limit stops the run as interrupted (resumable),
    not "finished" at the lr it trained at; and a schedule that ends where its decay would start
    (as an earlier release could record) reads the floor instead of dividing by zero."""
    cfg = dataclasses.replace(WSD if schedule == "wsd" else COSINE, min_lr_ratio=0.0)
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(list(model.parameters()), cfg, torch.device("cpu"))
    end = ScheduleEnd()
    scheduler = build_scheduler(optimizer, cfg, 1000, end)
    fit = TimeFit(
        cfg, 1000.0, 1000, scheduler, end, first_step=0, device=torch.device("cpu"), world_size=1
    )
    for step in range(1, 41):  # 0.1 s a step: the limit is far; then step 40 takes 999 s
        optimizer.step()
        scheduler.step()
        clock.now += 0.1 if step < 40 else 999.0
        assert fit.observe(step) is None
    assert clock.now >= 1000.0 and end.fitted is None
    assert not fit.finish_at_limit(40)  # interrupted: a rerun trains on
    progress = None if schedule == "wsd" else 0.03  # cosine's fitted ends carry it
    for end_step in (41, 40):
        fitted = FittedEnd(end=end_step, decay_from=41, progress=progress, schedule=schedule)
        assert lr_factor(40, 1000, cfg.warmup_ratio, 0.0, schedule, 0.2, fitted) == 0.0


def test_a_limit_at_the_end_of_a_decay_to_a_floor_finishes_the_run(clock: FakeClock) -> None:
    """optim.min_lr_ratio above ANNEALED: the decay is over when the lr is at its floor."""
    lrs, fit, frozen = fitted_run(clock, COSINE, 1000, 60.0, 0.1)  # min_lr_ratio 0.1
    (first, *_), fitted = frozen, fit.end.fitted
    assert fitted is not None and first < fitted.end < 1000
    assert fit.finish_at_limit(fitted.end - 1)  # the next step's lr is the floor: finished
    assert fit.end.fitted.end == fitted.end - 1


def test_a_generous_limit_or_the_field_off_changes_nothing(clock: FakeClock) -> None:
    for cfg in (WSD, COSINE):
        clock.now = 0.0
        reference, _, _ = fitted_run(clock, cfg, 300, limit=None, s_per_step=1.0)
        assert reference == [0.1 * old_lr_factor(s, 300, *shape(cfg)) for s in range(300)]
        lrs, fit, frozen = fitted_run(clock, cfg, 300, limit=310.0, s_per_step=1.0)  # 303 fit
        assert frozen == {} and lrs == reference and fit.rate.steps == 290
        off = dataclasses.replace(cfg, fit_time_limit=False)
        lrs, fit, frozen = fitted_run(clock, off, 300, limit=30.0, s_per_step=1.0)
        assert not fit.active and frozen == {} and lrs == reference


def test_several_ranks_apply_the_agreed_end_one_step_late(clock: FakeClock) -> None:
    """The all-reduced proposal is read at the next step (a group of one stands in for
    several ranks): the same end, a decay from one step later."""
    alone, _, frozen = fitted_run(clock, WSD, 1000, limit=600.0, s_per_step=1.0)
    [(step, fitted)] = frozen.items()
    clock.now = 0.0
    with group_of_one():
        lrs, _, agreed = fitted_run(clock, WSD, 1000, limit=600.0, s_per_step=1.0, world=2)
    assert agreed == {step + 1: FittedEnd(end=fitted.end, decay_from=step + 2, schedule="wsd")}
    assert lrs[:step] == alone[:step] and lrs[step] == 0.1 and len(lrs) == fitted.end


def factor(step: int, cfg: OptimConfig, total: int, fitted: FittedEnd | None) -> float:
    """lr_factor at 1-based step `step`."""
    return lr_factor(step - 1, total, *shape(cfg)[:3], cfg.decay_ratio, fitted)


def assert_annealed(lrs: list[float], cfg: OptimConfig, total: int) -> None:
    """Non-increasing after the warmup, the floor exactly at the last step, not before."""
    warmup = math.ceil(cfg.warmup_ratio * total)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :], strict=False))
    assert lrs[-1] == 0.1 * cfg.min_lr_ratio and lrs[-2] > lrs[-1]


def assert_no_jump(lrs: list[float], step: int) -> None:
    """The lr falls from step `step` (a decision's) to the next about as much as from that one
    to the one after, not by a step down: the re-mapped curve starts where the lr was."""
    assert 0 < lrs[step - 1] - lrs[step] <= 1.05 * (lrs[step] - lrs[step + 1])


def test_cosine_is_remapped_onto_the_steps_the_limit_leaves(clock: FakeClock) -> None:
    # 1 s a step and 600 s for 1000 steps: the rate is known after step 30 (10 compile steps,
    # 20 measured), when 570 s are left: 558 more steps fit
    lrs, fit, fitted = fitted_run(clock, COSINE, 1000, limit=600.0, s_per_step=1.0)
    p30 = (30 - 1 - 10) / 990  # the configured progress at step 30
    assert fitted == {30: FittedEnd(588, 31, p30, schedule="cosine")}  # a steady rate
    assert len(lrs) == 588 and fit.active  # stops at the end; would shorten again if slower
    reference = [0.1 * old_lr_factor(s, 1000, *shape(COSINE)) for s in range(1000)]
    assert lrs[:30] == reference[:30]
    # continuous at step 30: the re-mapped curve passes through its lr there
    assert factor(30, COSINE, 1000, fitted[30]) == reference[29] / 0.1
    assert_no_jump(lrs, 30)
    assert_annealed(lrs, COSINE, 1000)
    # halfway through the re-mapped steps, halfway from p30 to the floor in progress
    half = lr_factor(30 + 279 - 1, 1000, 0.01, 0.1, "cosine", 0.2, fitted[30])
    progress = p30 + 0.5 * (1 - p30)
    assert half == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def test_cosine_is_first_fitted_at_the_warmups_last_step(clock: FakeClock) -> None:
    """A projection that falls short during the warmup waits for its last step (the warmup
    runs as configured either way); the re-mapped cosine starts at the peak."""
    cfg = dataclasses.replace(COSINE, warmup_ratio=0.05)  # 50 steps; projections from step 30
    lrs, _, fitted = fitted_run(clock, cfg, 1000, limit=600.0, s_per_step=1.0)
    assert fitted == {50: FittedEnd(589, 52, 0.0, schedule="cosine")}
    reference = [0.1 * old_lr_factor(s, 1000, *shape(cfg)) for s in range(1000)]
    assert lrs[:51] == reference[:51] and lrs[49] == lrs[50] == 0.1  # warmup, then the peak
    assert_annealed(lrs, cfg, 1000) and len(lrs) == 589


def test_a_long_warmup_measures_the_rate_before_the_first_fit(clock: FakeClock) -> None:
    """pystd's shape (16,000 steps configured, a 640-step warmup, 884 s): the first 40 steps
    slow (0.15 s: the loader starting, the first compilations), then 0.087 s. Fitted at step
    30 from the slow steps, the end came out ~40% short (5,776) and was lengthened only at
    step 1,441 (the cooldown counts from the decay's start, 641); fitted at the warmup's last
    step, it is within a few percent of where the run ends (the slow steps still weigh a
    little in the mean: one small lengthening at most). Two ranks agree on it a step late."""
    cfg = OptimConfig(lr=2e-3, schedule="cosine", warmup_ratio=0.04, min_lr_ratio=0.0)

    def pace(step: int) -> float:
        return 0.15 if step <= 40 else 0.087

    lrs, _, fitted = fitted_run(clock, cfg, 16000, 884.0, pace)
    assert list(fitted)[0] == 640 and len(fitted) <= 2, fitted  # not at step 30
    assert fitted[640].progress == 0.0 and fitted[640].decay_from == 642
    assert fitted[640].end > 0.95 * len(lrs)
    assert len(lrs) == list(fitted.values())[-1].end and clock.now <= 884.0
    assert len(lrs) > 0.97 * (640 + (884.0 - 40 * 0.15 - 600 * 0.087) / 0.087)
    assert_annealed(lrs, cfg, 16000)
    clock.now = 0.0
    with group_of_one():
        _, _, agreed = fitted_run(clock, cfg, 16000, 884.0, pace, world=2)
    assert list(agreed)[0] == 641 and agreed[641].decay_from == 642, agreed
    assert agreed[641].progress == 0.0


def test_a_slowdown_remaps_cosine_again_continuously(clock: FakeClock) -> None:
    # 1 s a step, then 2 s from step 200: 588 steps planned, 400 fit
    lrs, _, fitted = fitted_run(clock, COSINE, 1000, 600.0, lambda s: 1.0 if s < 200 else 2.0)
    assert list(fitted)[0] == 30 and len(fitted) >= 2
    ends = [f.end for f in fitted.values()]
    assert ends == sorted(ends, reverse=True) and len(lrs) == ends[-1] <= 400
    previous = None
    for step, fit in fitted.items():
        assert fit.decay_from == step + 1
        # the lr at the decision step is the same on the old curve and the new
        assert factor(step, COSINE, 1000, fit) == factor(step, COSINE, 1000, previous)
        assert_no_jump(lrs, step)
        previous = fit
    assert_annealed(lrs, COSINE, 1000)
    # a 1% slowdown stays within the margin (and the 2% of time held back)
    clock.now = 0.0
    lrs, _, fitted = fitted_run(clock, COSINE, 1000, 600.0, lambda s: 1.0 if s < 200 else 1.01)
    assert list(fitted) == [30] and len(lrs) == 588


def test_a_pessimistic_first_fit_is_lengthened_early_and_stays_continuous(
    clock: FakeClock,
) -> None:
    """The first 30 steps at 3 s (a loader starting, compilations), then 1 s: the first fit,
    at step 30, is far too short; the faster steps move the end later (up to the configured
    end, never past it), with the lr continuous and never rising. A steady run (the other
    tests) is never lengthened: its end is the first fit's."""
    lrs, _, fitted = fitted_run(clock, COSINE, 1000, 900.0, lambda s: 3.0 if s <= 30 else 1.0)
    ends = [f.end for f in fitted.values()]
    assert list(fitted)[0] == 30 and ends[0] < 400, fitted
    assert max(ends) > ends[0] + 200 and max(ends) <= 1000
    assert len(lrs) == ends[-1] and 30 * 3 + (len(lrs) - 30) <= 900  # inside the limit
    previous = None
    for step, fit in fitted.items():
        assert factor(step, COSINE, 1000, fit) == factor(step, COSINE, 1000, previous)
        # no step down at the decision: its fall no larger than the one before or after it
        drops = [lrs[i - 1] - lrs[i] for i in (step - 1, step, step + 1)]
        assert 0 < drops[1] <= 1.05 * max(drops[0], drops[2]), (step, drops)
        previous = fit
    assert_annealed(lrs, COSINE, 1000)
    # the lengthening stops once a third of the fitted decay is done
    last_move = list(fitted)[-1]
    assert 3 * (last_move - (list(fitted.values())[-2].decay_from - 1)) < ends[-2] - 1


def test_a_restarted_rate_forgets_the_streamed_epochs_pace(clock: FakeClock) -> None:
    """--follow on pystd's scale: 667 steps at 0.15 s (the streamed epoch: sharing the GPU with
    extract, waiting for its shards), then 0.086 s, an evaluation of 5 s every 1,500 steps,
    1,100 s. Measured on from the start, the slow mean keeps pulling the end in (8 re-maps);
    measured afresh when the streamed epoch ends, the fit lengthens at once and settles (3),
    with more steps at a higher lr, still annealed and inside the limit."""
    cfg = OptimConfig(lr=2e-3, schedule="cosine", warmup_ratio=0.04, min_lr_ratio=0.0)

    def pace(step: int) -> float:
        return (0.15 if step <= 667 else 0.086) + (5.0 if step % 1500 == 0 else 0.0)

    kept, _, kept_fits = fitted_run(clock, cfg, 16000, 1100.0, pace)
    clock.now = 0.0
    fresh, _, fresh_fits = fitted_run(clock, cfg, 16000, 1100.0, pace, restart_at=667)
    assert len(fresh_fits) < len(kept_fits) and len(fresh) > len(kept), (fresh_fits, kept_fits)
    assert sum(fresh) / len(fresh) > 1.05 * sum(kept) / len(kept)
    assert sum(pace(step) for step in range(1, len(fresh) + 1)) <= 1100.0
    assert_annealed(fresh, cfg, 16000)  # the lr never rose after the warmup


def h200_step_times(doubled_from: int | None = None) -> list[float]:
    """Seconds per step of a pystd-like run on an H200 (10,000 steps configured, ~8,800 fit in
    900 s), after the log that made ~80 decisions: 1 s for the 10 compiling steps, then
    0.083-0.100 s, with five stretches of ~100 steps at 0.100-0.120 s (the loader's noise: a
    50-step median rising from 0.095 to 0.110 and back) and an evaluation every 1,500 steps
    (5 s, 30 s the first: it compiles). From step `doubled_from` on, every step twice as long."""
    rng = random.Random(0)
    slow = [(150, 250), (2150, 2270), (4000, 4100), (6000, 6120), (7700, 7800)]
    times = []
    for step in range(1, 10_001):
        if step <= 10:
            seconds = 1.0
        elif any(start <= step < stop for start, stop in slow):
            seconds = rng.uniform(0.100, 0.120)
        else:
            seconds = rng.uniform(0.083, 0.100)
        if step % 1500 == 0:
            seconds += 30.0 if step == 1500 else 5.0
        times.append(seconds if doubled_from is None or step < doubled_from else 2 * seconds)
    return times


def assert_cooled_down(fitted: dict[int, FittedEnd]) -> None:
    """Each re-map COOLDOWN of the run's steps after the one before, unless urgent: sooner by
    more than URGENT_MARGIN of the steps left."""
    steps = list(fitted)
    for before, step in zip(steps, steps[1:], strict=False):
        end, new = fitted[before].end, fitted[step].end
        urgent = new < end - time_fit.URGENT_MARGIN * (end - step)
        assert urgent or step - before >= time_fit.COOLDOWN * 10_000, (before, step)


def test_a_noisy_step_time_moves_the_cosine_a_few_times(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's noise re-maps the cosine a handful of times, not at every twitch of the
    rate: the first fit, the first evaluation's compile (an urgent shortening) and the
    lengthenings as the mean forgets it; the run ends annealed, inside the limit, having used
    most of it."""
    times = h200_step_times()
    lrs, _, fitted = fitted_run(clock, COSINE, 10_000, 900.0, lambda s: times[s - 1])
    ends = [f.end for f in fitted.values()]
    assert len(fitted) <= 6, fitted
    directions = [b > a for a, b in zip([10_000, *ends], ends, strict=False)]
    assert sum(a != b for a, b in zip(directions, directions[1:], strict=False)) <= 1
    assert_cooled_down(fitted)
    assert len(lrs) == ends[-1] and 0.97 * 900 < clock.now <= 900.0
    assert_annealed(lrs, COSINE, 10_000)
    # the same trace through a 50-step median and no cooldown: it flip-flops
    clock.now = 0.0
    monkeypatch.setattr(time_fit, "COOLDOWN", 0.0)
    monkeypatch.setattr(time_fit, "StepRate", functools.partial(time_fit.StepRate, 50))
    _, _, twitchy = fitted_run(clock, COSINE, 10_000, 900.0, lambda s: times[s - 1])
    assert len(twitchy) > 30


def test_a_step_time_that_doubles_shortens_the_cosine_at_once(clock: FakeClock) -> None:
    """Twice as slow from step 5,000: re-mapped once the 300-step median shows it, at once (no
    cooldown) however often; the run still ends annealed inside the limit."""
    times = h200_step_times(doubled_from=5000)
    lrs, _, fitted = fitted_run(clock, COSINE, 10_000, 900.0, lambda s: times[s - 1])
    before = [f.end for step, f in fitted.items() if step < 5000][-1]
    assert before > 8500
    final = list(fitted.values())[-1].end
    assert len(lrs) == final < 7100 and clock.now <= 900.0
    # within 150 steps, the end in force is most of the way to where it settles
    by_5150 = [f.end for step, f in fitted.items() if step <= 5150][-1]
    assert by_5150 - final < 0.2 * (before - final)
    assert_cooled_down(fitted)
    steps = list(fitted)  # the urgent ones came sooner
    assert any(b - a < time_fit.COOLDOWN * 10_000 for a, b in zip(steps, steps[1:], strict=False))
    assert_annealed(lrs, COSINE, 10_000)


def test_a_resumed_cosine_fit_only_shortens_under_a_new_limit(clock: FakeClock) -> None:
    """A job resumed at step 300 of a cosine fitted to end at 588 (the trainer passes the
    fitted end as the run's end): a new limit that leaves room changes nothing, a short one
    re-maps from the progress there."""
    first = FittedEnd(end=588, decay_from=31, progress=(30 - 1 - 10) / 990, schedule="cosine")
    for limit, s_per_step in ((1000.0, 1.0), (100.0, 1.0)):
        model = torch.nn.Linear(2, 2)
        optimizer = build_optimizer(list(model.parameters()), COSINE, torch.device("cpu"))
        end = ScheduleEnd(fitted=first)
        scheduler = build_scheduler(optimizer, COSINE, 1000, end)
        for _ in range(300):
            optimizer.step()
            scheduler.step()
        refresh_lr(scheduler)
        cpu = torch.device("cpu")
        fit = TimeFit(COSINE, limit, 588, scheduler, end, first_step=300, device=cpu, world_size=1)
        moved, lrs = {}, []
        for step in range(301, 589):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            clock.now += s_per_step
            if (fitted := fit.observe(step)) is not None:
                moved[step] = fitted
            if step == end.fitted.end:
                break
        if limit == 1000.0:
            assert moved == {} and len(lrs) == 288
            continue
        [(step, fitted)] = moved.items()  # the rate known at step 330, 70 s left
        assert (step, fitted.end, fitted.decay_from) == (330, 330 + 68, 331)
        assert factor(330, COSINE, 1000, fitted) == factor(330, COSINE, 1000, first)
        assert_no_jump(lrs, 330 - 300)
        assert lrs[-1] == 0.1 * 0.1 and len(lrs) == 398 - 300


def test_a_fit_is_restored_under_its_own_schedule_only() -> None:
    """A resumed fit holds under the optim.schedule it was fitted under, whether it carries a
    progress or not (a wsd decay re-mapped mid-way does), and is dropped under the other."""
    for fitted in (
        FittedEnd(57, 52, 0.25, schedule="wsd"),
        FittedEnd(57, 52, schedule="wsd"),
        FittedEnd(57, 52, 0.25, schedule="cosine"),
    ):
        for cfg in (WSD, COSINE):
            model = torch.nn.Linear(2, 2)
            optimizer = build_optimizer(list(model.parameters()), cfg, torch.device("cpu"))
            end = ScheduleEnd()
            scheduler = build_scheduler(optimizer, cfg, 60, end)
            last = time_fit.restore_fitted(fitted, end, scheduler, cfg, 60)
            kept = cfg.schedule == fitted.schedule
            assert (last, end.fitted) == ((57, fitted) if kept else (60, None)), (fitted, cfg)


def test_several_ranks_remap_cosine_one_step_late(clock: FakeClock) -> None:
    with group_of_one():
        lrs, _, agreed = fitted_run(clock, COSINE, 1000, limit=600.0, s_per_step=1.0, world=2)
    p31 = (31 - 1 - 10) / 990
    assert agreed == {31: FittedEnd(588, 32, p31, schedule="cosine")}
    reference = [0.1 * old_lr_factor(s, 1000, *shape(COSINE)) for s in range(1000)]
    assert lrs[:31] == reference[:31] and len(lrs) == 588
    assert_annealed(lrs, COSINE, 1000)


# The trainer end to end: 60 steps of wsd, the fake clock 100 s a look, a 3600 s limit: the
# projection after step 35 ends the run at step 44, decaying from step 36.
SETS = ["optim.max_steps=60", "optim.schedule=wsd", "run.time_limit_s=3600"]
SETS += ["run.checkpoint_every=20", "run.keep_checkpoints=5", "run.progress=false"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("fit") / "store", FactorySpec(num_sequences=9))


def train(store: Path, out: Path, *sets: str) -> list[dict]:
    base = [f"data.store={store}", f"run.out={out}", *SETS]
    run_train(build_config(TrainConfig, DEBUG, "train", [*base, *sets]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_stops_annealed_at_the_fitted_end_and_resumes_the_same_decay(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time_fit, "monotonic", FakeClock(tick=100.0))
    out = tmp_path / "run"
    full = train(store, out)
    assert [r["step"] for r in full] == list(range(1, 45))
    [event] = [r for r in full if "schedule_end" in r]
    assert (event["step"], event["schedule_end"], event["decay_from"]) == (35, 44, 36)
    assert full[-1]["lr"] == 0.0 and full[35]["lr"] < full[34]["lr"] == 3e-3
    assert (out / "export" / "model.safetensors").is_file()
    meta = json.loads((out / "step-000040" / "meta.json").read_text())["train_state"]
    assert (meta["fit_end"], meta["fit_decay_from"]) == (44, 36)
    before = json.loads((out / "step-000020" / "meta.json").read_text())["train_state"]
    assert before["fit_end"] is None

    # killed after step 40's checkpoint; rerun with no limit (and the real clock): the same
    # decay to step 44, the same numbers
    for name in ("step-000044", "export"):
        for path in sorted((out / name).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (out / name).rmdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:40]))
    monkeypatch.undo()
    resumed = train(store, out, "run.time_limit_s=null")
    assert [r["step"] for r in resumed] == list(range(1, 45))
    assert [(r["lr"], r["loss"]) for r in resumed] == [(r["lr"], r["loss"]) for r in full]


def slowing_clock(slow_from: int) -> Callable[[], float]:
    """time_fit's clock in the trainer, read as the limit starts counting and then once a step
    from step 10 on (WARM_STEPS): 100 s a read, 200 s from read `slow_from` on."""
    reads, clock = iter(range(1, 10_000)), FakeClock()

    def read() -> float:
        clock.now += 100.0 if next(reads) < slow_from else 200.0
        return clock.now

    return read


def test_train_remaps_a_late_wsd_decay_and_resumes_the_same_curve(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wsd, its decay configured over steps 49-60; twice as slow from step 31, the projection
    falls short only after step 51, mid-decay: the rest of the decay (progress 3/12 there) is
    re-mapped onto steps 52-57, no step falling by more than its slope. Resumed from step 54's
    checkpoint without a limit: the same curve, the same numbers."""
    monkeypatch.setattr(time_fit, "monotonic", slowing_clock(31 - 8))
    out = tmp_path / "run"
    sets = ["run.time_limit_s=7700", "run.checkpoint_every=18"]
    full = train(store, out, *sets)
    assert [r["step"] for r in full] == list(range(1, 58))
    [event] = [r for r in full if "schedule_end" in r]
    assert (event["step"], event["schedule_end"], event["decay_from"]) == (51, 57, 52)
    lrs = [r["lr"] for r in full]
    assert lrs[:51] == [3e-3 * old_lr_factor(s, 60, 0.04, 0.0, "wsd") for s in range(51)]
    drops = [a - b for a, b in zip(lrs[50:], lrs[51:], strict=False)]
    slope = wsd_slope(51, 3 / 12, 57, OptimConfig(lr=3e-3, min_lr_ratio=0.0))
    assert 0 < max(drops) <= slope and min(drops) > 0 and lrs[-1] == 0.0
    meta = json.loads((out / "step-000054" / "meta.json").read_text())["train_state"]
    fit_keys = ("fit_end", "fit_decay_from", "fit_progress", "fit_schedule")
    assert tuple(meta[key] for key in fit_keys) == (57, 52, 3 / 12, "wsd")

    for name in ("step-000057", "export"):
        for path in sorted((out / name).rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (out / name).rmdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:54]))
    monkeypatch.undo()
    resumed = train(store, out, "run.time_limit_s=null", "run.checkpoint_every=18")
    assert [(r["lr"], r["loss"]) for r in resumed] == [(r["lr"], r["loss"]) for r in full]


def test_train_stops_a_cosine_run_annealed_and_resumes_the_same_curve(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cosine (warmup 3 steps): the rate is known after step 30, 1,500 s left: the rest of the
    cosine re-mapped onto steps 31..44."""
    monkeypatch.setattr(time_fit, "monotonic", FakeClock(tick=100.0))
    out = tmp_path / "run"
    full = train(store, out, "optim.schedule=cosine")
    assert [r["step"] for r in full] == list(range(1, 45))
    [event] = [r for r in full if "schedule_end" in r]
    assert (event["step"], event["schedule_end"], event["decay_from"]) == (30, 44, 31)
    lrs = [r["lr"] for r in full]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False)) and lrs[-1] == 0.0
    configured = [3e-3 * old_lr_factor(s, 60, 0.04, 0.0) for s in range(60)]
    assert lrs[:30] == configured[:30]
    meta = json.loads((out / "step-000040" / "meta.json").read_text())["train_state"]
    assert (meta["fit_end"], meta["fit_decay_from"]) == (44, 31)
    assert meta["fit_progress"] == (30 - 1 - 3) / 57
    before = json.loads((out / "step-000020" / "meta.json").read_text())["train_state"]
    assert before["fit_end"] is None and before["fit_progress"] is None

    # killed after step 40's checkpoint; rerun with no limit, then with one too short to
    # measure a rate in (4 steps): the same curve to step 44, the same numbers
    for sets in (["run.time_limit_s=null"], ["run.time_limit_s=1000"]):
        for name in ("step-000044", "export"):
            for path in sorted((out / name).rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            (out / name).rmdir()
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in full[:40]))
        monkeypatch.setattr(time_fit, "monotonic", FakeClock(tick=100.0))
        resumed = train(store, out, "optim.schedule=cosine", *sets)
        assert [r["step"] for r in resumed] == list(range(1, 45))
        assert [(r["lr"], r["loss"]) for r in resumed] == [(r["lr"], r["loss"]) for r in full]


def _limit_after(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """run.time_limit_s reached after step `steps` (StopRequests asks once after every step
    that is not the last)."""
    calls = iter(range(1, 10_000))
    monkeypatch.setattr(
        stop_module.StopRequests,
        "_local_code",
        lambda self: stop_module.TIME_LIMIT_EXIT if next(calls) >= steps else 0,
    )


def test_a_limit_one_step_before_the_fitted_end_finishes_the_run(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limit arrives after step 43 of a cosine fitted to end at 44 (the last evaluations
    outran the planned rate, as in the twenty-second session's recipe: stopped at 13,501 of
    13,502): the decay is over (the next lr 0), so the run is complete: evaluated, exported,
    no Stopped error, and a rerun trains nothing. The limit at step 40, mid-decay, still stops
    it resumably with the time limit's exit code."""
    monkeypatch.setattr(time_fit, "monotonic", FakeClock(tick=100.0))
    _limit_after(monkeypatch, 43)
    out = tmp_path / "run"
    rows = train(store, out, "optim.schedule=cosine")
    assert rows[-1]["step"] == 43 and "eval_loss" in rows[-1]
    assert (out / "export" / "model.safetensors").is_file()
    meta = json.loads((out / "step-000043" / "meta.json").read_text())["train_state"]
    assert meta["fit_end"] == 43
    monkeypatch.setattr(time_fit, "monotonic", FakeClock(tick=100.0))
    again = train(store, out, "optim.schedule=cosine")
    assert [r["step"] for r in again] == [r["step"] for r in rows]  # nothing more trained

    monkeypatch.setattr(time_fit, "monotonic", FakeClock(tick=100.0))
    _limit_after(monkeypatch, 40)
    with pytest.raises(Stopped) as stopped:
        train(store, tmp_path / "mid", "optim.schedule=cosine")
    assert stopped.value.exit_code == stop_module.TIME_LIMIT_EXIT
    assert not (tmp_path / "mid" / "export").exists()
