"""optim.fit_time_limit: under run.time_limit_s a wsd run projects the last step it can finish
and, when that comes before its configured end, decays to it and stops there annealed; the
decision is frozen once and carried by checkpoints. The clock is a fake one (no timing)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from store_factory import FactorySpec, build_store

from common.config import build_config
from stage2_train import time_fit
from stage2_train.config import OptimConfig, TrainConfig
from stage2_train.schedule import (
    FittedEnd,
    ScheduleEnd,
    build_optimizer,
    build_scheduler,
    lr_factor,
)
from stage2_train.time_fit import TimeFit
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"
WSD = OptimConfig(lr=0.1, schedule="wsd", warmup_ratio=0.04, decay_ratio=0.2, min_lr_ratio=0.1)


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


def fitted_run(
    clock: FakeClock,
    cfg: OptimConfig,
    total: int,
    limit: float | None,
    s_per_step: float,
    world: int = 1,
) -> tuple[list[float], TimeFit, dict[int, FittedEnd]]:
    """Scheduler steps (no model) to the end, the clock moving `s_per_step` a step: the lr of
    every step (1-based step = list index + 1), the planner, and what observe() returned, by
    step."""
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
        clock.now += s_per_step
        if (fitted := fit.observe(step)) is not None:
            frozen[step] = fitted
            total = fitted.end
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


def test_a_limit_that_suddenly_looks_short_only_ends_the_decay_sooner(clock: FakeClock) -> None:
    """Already decaying toward the configured end when the rate drops: the decay keeps its
    start and ends at the projection, the lr only ever going down."""
    cfg = WSD
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(list(model.parameters()), cfg, torch.device("cpu"))
    end = ScheduleEnd()
    scheduler = build_scheduler(optimizer, cfg, 100, end)
    cpu = torch.device("cpu")
    fit = TimeFit(cfg, 1000.0, 100, scheduler, end, first_step=0, device=cpu, world_size=1)
    lrs = []
    for step in range(1, 91):  # configured decay: steps 81..100
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        clock.now += 1.0 if step < 85 else 200.0  # by step 88, ~10 more fit
        fitted = fit.observe(step)
        if fitted is not None:
            break
    assert fitted is not None and fitted.decay_from == 81 and step < fitted.end < 100
    lrs.append(optimizer.param_groups[0]["lr"])
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:], strict=False))


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
    for total in (1, 7, 100, 1001):  # the bare factor too, exactly
        for step in range(0, total + 2, max(total // 50, 1)):
            for args in ((0.1, 0.1), (0.04, 0.0, "wsd", 1 / 3), (0.0, 0.2, "wsd", 1.0)):
                assert lr_factor(step, total, *args) == old_lr_factor(step, total, *args)


def test_a_generous_limit_or_cosine_changes_nothing(clock: FakeClock) -> None:
    reference, _, _ = fitted_run(clock, WSD, 300, limit=None, s_per_step=1.0)
    lrs, fit, frozen = fitted_run(clock, WSD, 300, limit=310.0, s_per_step=1.0)  # 303 fit
    assert frozen == {} and lrs == reference and fit.rate.steps > 0
    cosine = OptimConfig(lr=0.1, schedule="cosine")
    lrs, fit, frozen = fitted_run(clock, cosine, 300, limit=30.0, s_per_step=1.0)
    assert not fit.active and frozen == {} and len(lrs) == 300
    off = dataclasses.replace(WSD, fit_time_limit=False)
    lrs, fit, frozen = fitted_run(clock, off, 300, limit=30.0, s_per_step=1.0)
    assert frozen == {} and lrs == reference


def test_several_ranks_apply_the_agreed_end_one_step_late(clock: FakeClock) -> None:
    """The all-reduced proposal is read at the next step (a group of one stands in for
    several ranks): the same end, a decay from one step later."""
    alone, _, frozen = fitted_run(clock, WSD, 1000, limit=600.0, s_per_step=1.0)
    [(step, fitted)] = frozen.items()
    clock.now = 0.0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lrs, _, agreed = fitted_run(clock, WSD, 1000, limit=600.0, s_per_step=1.0, world=2)
    finally:
        dist.destroy_process_group()
    assert agreed == {step + 1: FittedEnd(end=fitted.end, decay_from=step + 2)}
    assert lrs[:step] == alone[:step] and lrs[step] == 0.1 and len(lrs) == fitted.end


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
