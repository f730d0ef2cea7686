"""One loader iterator for the whole run (plan.py's PlanSampler with `steps`): the batches it
yields across epoch ends are those of the per-epoch iterators the loop used to open, the loop's
epoch count matches the epoch in every key, and a resume from any step, epoch ends included,
continues the same stream."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_factory import FactorySpec, build_store

from common.store import open_store
from stage2_train.config import TrainDataConfig
from stage2_train.follow import FollowPlan
from stage2_train.plan import EpochPlan, ItemKey, PlanSampler

Steps = list[tuple[int, int, list[list[ItemKey]]]]  # (epoch, step in epoch, micro-batches)


def per_epoch(plan: EpochPlan | FollowPlan, total: int) -> Steps:
    """The loop before one iterator: a new iterator at each epoch's first step."""
    sampler, out = PlanSampler(plan), []
    epoch, step_in_epoch, batches = 0, 0, None
    for _ in range(total):
        if plan.epoch_done(epoch, step_in_epoch):
            epoch, step_in_epoch, batches = epoch + 1, 0, None
        if batches is None:
            sampler.set_position(epoch, step_in_epoch)
            batches = iter(sampler)
        out.append((epoch, step_in_epoch, [next(batches) for _ in range(plan.accum)]))
        step_in_epoch += 1
    return out


def one_iterator(plan: EpochPlan | FollowPlan, total: int, at: tuple[int, int, int]) -> Steps:
    """The loop now (train.py): one iterator from the position `at` = (step, epoch, step in
    epoch) a checkpoint holds, the epoch counted by `epoch_done`; it yields nothing more."""
    step, epoch, step_in_epoch = at
    sampler, out = PlanSampler(plan), []
    sampler.set_position(*_next_position(plan, epoch, step_in_epoch), total - step)
    batches = iter(sampler)
    assert len(sampler) == (total - step) * plan.accum
    for _ in range(step, total):
        epoch, step_in_epoch = _next_position(plan, epoch, step_in_epoch)
        out.append((epoch, step_in_epoch, [next(batches) for _ in range(plan.accum)]))
        step_in_epoch += 1
    assert next(batches, None) is None  # nothing past the run
    return out


def _next_position(plan: EpochPlan | FollowPlan, epoch: int, step_in_epoch: int) -> tuple:
    if plan.epoch_done(epoch, step_in_epoch):
        return epoch + 1, 0
    return epoch, step_in_epoch


def check_stream(plan: EpochPlan | FollowPlan, total: int) -> Steps:
    """One iterator equals the per-epoch iterators, from the start and from every resume."""
    want = per_epoch(plan, total)
    assert one_iterator(plan, total, (0, 0, 0)) == want
    for epoch, _, micro in want:
        assert all(key[1] == epoch for keys in micro for key in keys)  # the loop's count holds
    for k in range(1, total):  # a checkpoint after step k holds the position before its top
        epoch, step_in_epoch, _ = want[k - 1]
        assert one_iterator(plan, total, (k, epoch, step_in_epoch + 1)) == want[k:]
    return want


@pytest.mark.parametrize(
    "num_train,world,batch,accum",
    [(12, 1, 2, 2), (11, 1, 2, 2), (13, 2, 2, 1), (11, 3, 1, 2), (7, 1, 1, 1)],
)
def test_one_iterator_yields_the_per_epoch_batches(num_train, world, batch, accum) -> None:
    """Shuffled epochs, with and without padding, each rank's share (rank/world simulated):
    2-3 epochs and a part of the next, from the start and resumed at every step."""
    seen = []
    for rank in range(world):
        plan = EpochPlan(num_train, world, rank, batch, accum, seed=3)
        total = plan.steps_per_epoch * 2 + plan.steps_per_epoch // 2 + 1
        want = check_stream(plan, total)
        assert {e for e, _, _ in want} == {0, 1, 2}
        seen += [key for e, _, micro in want if e < 2 for keys in micro for key in keys]
    for epoch in (0, 1):  # every sequence once an epoch over the ranks, and the padding
        real = sorted(k[0] for k in seen if k[1] == epoch and not k[2])
        assert real == list(range(num_train))
        pads = [k for k in seen if k[1] == epoch and k[2]]
        assert len(pads) == -num_train % (world * batch * accum)


@pytest.mark.parametrize("world,batch,accum", [(1, 2, 1), (2, 1, 2)])
def test_one_iterator_across_a_streamed_epoch(tmp_path: Path, world, batch, accum) -> None:
    """--follow on a complete store: the streamed epoch 0 (store order, padded at its end), then
    the shuffles of the complete store, as the per-epoch iterators gave them."""
    store = build_store(tmp_path / "s", FactorySpec(num_sequences=13, sequences_per_shard=3))
    cfg = TrainDataConfig(store=str(store), holdout_sequences=2)
    for rank in range(world):
        plan = FollowPlan(open_store(store), cfg, world, rank, batch, accum)
        total = plan.steps_per_epoch * 3  # the schedule's bound: a part of a fourth epoch
        want = check_stream(plan, total)
        streamed = [key[0] for e, _, micro in want if e == 0 for keys in micro for key in keys]
        assert streamed[:batch] == list(range(rank * batch, rank * batch + batch))
        assert max(e for e, _, _ in want) == 3


def test_steps_cross_epoch_ends_and_none_keeps_one_epoch() -> None:
    plan = EpochPlan(10, 1, 0, 2, 1, seed=0)
    sampler = PlanSampler(plan)
    sampler.set_position(1, 2)
    assert len(list(sampler)) == len(sampler) == 3
    sampler.set_position(1, 5, steps=7)  # starts exactly at an epoch's end
    keys = list(sampler)
    assert len(keys) == 7 and [k[0][1] for k in keys] == [2] * 5 + [3] * 2
