"""Which sequences each rank reads, in which order: the split, the epochs, the remainder.

The last `holdout_sequences` sequences of the store are held out for evaluation. Each epoch
shuffles the training sequences with a generator seeded by (seed, epoch). The order is cut into
optimizer steps of `world * batch * accum` sequences; within a step, micro-batch m of rank r
takes the slice [(m * world + r) * batch, ... + batch). Ranks therefore read disjoint sequences.

Remainder: when the training count is not a multiple of `world * batch * accum`, the last step
is filled with *padding items*, copies of the epoch's first sequences whose loss weights are
zero. Every sequence is seen exactly once per epoch, every rank runs the same number of steps,
and padding changes no loss and no gradient because the trainer normalises by the global sum
of weights (all-reduced), never by item counts. Held-out sequences are spread the same way.

`dflash train --follow` streams its first epoch in store order instead (stage2_train/follow.py),
with the same layout of positions over ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.store import StoreError, StoreInfo

if TYPE_CHECKING:  # follow.py builds on this module
    from stage2_train.follow import FollowPlan

# Key of one item: (global sequence index, epoch, is padding).
ItemKey = tuple[int, int, bool]

EVAL_EPOCH = -1  # anchors of held-out sequences use their own, fixed seed stream


@dataclass(frozen=True)
class SequenceSplit:
    """How many sequences the store has and which are held out (the last ones)."""

    num_sequences: int
    num_holdout: int

    @property
    def num_train(self) -> int:
        return self.num_sequences - self.num_holdout

    @property
    def holdout(self) -> range:
        return range(self.num_train, self.num_sequences)


def split_store(info: StoreInfo, holdout_sequences: int) -> SequenceSplit:
    """Count the sequences from the root attributes and check enough remain for training."""
    total = int(info.attrs.get("counts", {}).get("sequences", 0))
    if total == 0:
        raise StoreError(f"{info.path}: the store holds 0 sequences; extract some data first")
    if total <= holdout_sequences:
        raise StoreError(
            f"{info.path}: {total} sequences cannot spare data.holdout_sequences="
            f"{holdout_sequences} for evaluation and still train; lower it or extract more data"
        )
    return SequenceSplit(total, holdout_sequences)


class EpochPlan:
    """Which sequences rank `rank` reads at each micro-batch of each epoch."""

    def __init__(
        self, num_train: int, world: int, rank: int, batch: int, accum: int, seed: int
    ) -> None:
        self.num_train, self.world, self.rank = num_train, world, rank
        self.batch, self.accum, self.seed = batch, accum, seed
        self.per_step = world * batch * accum
        self.steps_per_epoch = -(-num_train // self.per_step)

    def padding_note(self) -> str | None:
        """What a step larger than the training sequences costs, or None: its slots past them
        are zero-weight padding, computed and learned nothing from."""
        if self.per_step <= self.num_train:
            return None
        fits = max(1, self.num_train // (self.world * self.accum))
        return (
            f"one optimizer step takes {self.per_step} sequences (world {self.world} x "
            f"optim.batch_sequences {self.batch} x optim.grad_accum {self.accum}) but the store "
            f"trains on {self.num_train}: {self.per_step - self.num_train} of each step's are "
            f"zero-weight padding, computed for nothing; set optim.batch_sequences={fits} or "
            "extract more data"
        )

    def order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_train, generator=gen)

    def epoch_done(self, epoch: int, steps_done: int) -> bool:
        """Whether `epoch` has no step past `steps_done` (every epoch has the same length)."""
        return steps_done >= self.steps_per_epoch

    def micro_batches(self, epoch: int, start_step: int = 0) -> Iterator[list[ItemKey]]:
        """This rank's micro-batches of `epoch`, from optimizer step `start_step` on."""
        order = self.order(epoch).tolist()
        padded = self.steps_per_epoch * self.per_step
        for step in range(start_step, self.steps_per_epoch):
            for m in range(self.accum):
                base = ((step * self.accum + m) * self.world + self.rank) * self.batch
                keys = []
                for pos in range(base, base + self.batch):
                    is_pad = pos >= self.num_train
                    keys.append((order[pos % self.num_train], epoch, is_pad))
                assert base + self.batch <= padded
                yield keys


class PlanSampler(torch.utils.data.Sampler[list[ItemKey]]):
    """A batch sampler over `plan` (an EpochPlan or a FollowPlan, stage2_train/follow.py) from
    step `start_step` of `epoch` on: to that epoch's end, or with `steps` set, for that many
    optimizer steps, epoch after epoch. The training loop takes the whole run from one iterator
    so that the loader's workers read on across epoch ends: an iterator per epoch drained their
    prefetch at each end and refilled it from empty (the step that began an epoch took ~1.7 s
    instead of ~75 ms, pystd at 16 sequences a step, 12 workers). The batches are the per-epoch
    iterators' end to end; a FollowPlan's streamed epoch ends where its `epoch_done` says. A run
    that stops early or whose schedule optim.fit_time_limit shortens leaves the batches its
    workers read ahead unused (as an epoch's iterator did mid-epoch)."""

    def __init__(self, plan: EpochPlan | FollowPlan) -> None:
        self.plan = plan
        self.epoch, self.start_step = 0, 0
        self.steps: int | None = None

    def set_position(self, epoch: int, start_step: int, steps: int | None = None) -> None:
        self.epoch, self.start_step, self.steps = epoch, start_step, steps

    def __iter__(self) -> Iterator[list[ItemKey]]:
        if self.steps is None:
            return self.plan.micro_batches(self.epoch, self.start_step)
        return self._run(self.steps * self.plan.accum)

    def _run(self, left: int) -> Iterator[list[ItemKey]]:
        """`left` micro-batches from the position on, crossing epoch ends; none pulled past
        the last (a streamed epoch's next one may wait for extract)."""
        epoch, start = self.epoch, self.start_step
        while left > 0:
            for keys in self.plan.micro_batches(epoch, start):
                yield keys
                left -= 1
                if left == 0:
                    return
            epoch, start = epoch + 1, 0

    def __len__(self) -> int:
        if self.steps is None:  # (a streamed epoch's end: the schedule's bound)
            return (self.plan.steps_per_epoch - self.start_step) * self.plan.accum
        return self.steps * self.plan.accum


class HoldoutSampler(torch.utils.data.Sampler[list[ItemKey]]):
    """This rank's share of the held-out sequences, padded like training (zero weights)."""

    def __init__(self, split: SequenceSplit, world: int, rank: int, batch: int) -> None:
        per_round = world * batch
        held = list(split.holdout)
        rounds = -(-len(held) // per_round) if held else 0
        self.batches = []
        for r in range(rounds):
            base = (r * world + rank) * batch
            self.batches.append(
                [
                    (held[p % len(held)], EVAL_EPOCH, p >= len(held))
                    for p in range(base, base + batch)
                ]
            )

    def ready(self) -> bool:
        """Whether there is anything to evaluate."""
        return bool(self.batches)

    def __iter__(self) -> Iterator[list[ItemKey]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
