"""`dflash train --follow`: train on a store while `dflash extract` is still writing it.

    dflash extract --config C --model M --data D --out STORE --devices 0,1 &
    dflash train --config C --store STORE --out RUN --devices 2,3 --follow

Epoch 0 is the *streamed epoch*: its position p is sequence p of the store, so it reads shard 0,
1, 2, ... row by row, each shard once its atomic rename has committed it (FORMAT.md). That is
extract's commit order up to the few shards its writers (or ranks, shard i % W) finish out of
turn; index order makes the stream a function of the store's plan alone, identical on every
rank with no communication, and its data position one number (the step) as in shuffled
epochs. Ranks share each step as EpochPlan does (micro-batch m of rank r takes positions
[((k * accum + m) * world + r) * batch, + batch)), so they read disjoint sequences. Later epochs
are EpochPlan's shuffles of the complete store.

Held out: the store's last `data.holdout_sequences` sequences, as without --follow (the same
split, so runs compare). Where training ends is known once the last shard is committed (only
it may hold fewer than `sequences_per_shard`): the stream waits for it only for its last
positions, and held-out evaluations are skipped (one log line) until those shards are there.

Length: the schedule counts `num_shards x sequences_per_shard - holdout` training sequences per
epoch, the planned upper bound in the root attributes from the start, so a resume before or
after the store completes builds the same schedule; a short last shard lets the run take a few
steps of one more shuffled epoch. `optim.max_steps` caps it as usual.

Waiting: caught up, the stream logs what it waits for and polls every `data.follow_poll_s`;
after `data.follow_timeout_s` without a new shard, while no process holds the store's writer
lock (the kernel drops it when extract dies, even by kill -9), it stops with one StoreError.
A lock found held counts as a new shard would: it is probed again `data.follow_timeout_s`
later, so an extract killed and restarted in between keeps the run waiting.
Every rank waits for the shards of the whole step, its peers' too, so that no rank waits in a
collective (under the process-group timeout) while another waits for extraction.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from common.logging import get_logger
from common.store import (
    HEAD_FILE,
    SHARD_ATTR,
    StoreError,
    StoreInfo,
    committed_shards,
    open_store,
    read_root_attrs,
    shard_name,
    shards_dir,
)
from stage1_extract.store_root import LOCK_FILE
from stage2_train.checkpoint import TrainState
from stage2_train.config import TrainDataConfig
from stage2_train.plan import EpochPlan, HoldoutSampler, ItemKey, SequenceSplit


def writer_lock_held(store: Path) -> bool:
    """Whether a `dflash extract` holds the store's writer lock. Probed with a shared,
    non-blocking flock released at once: only after data.follow_timeout_s without a new shard,
    so an extract starting in that instant (refused, rerun) is all it can disturb."""
    try:
        fd = os.open(Path(store) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the probe's lock when it was taken
    return False


class WaitInterrupted(Exception):
    """A stop request (stop.py) that came while the run waited for extraction."""

    def __init__(self, code: int) -> None:
        super().__init__(f"stop requested (exit code {code}) while waiting for extraction")
        self.code = code


class ExtractionWatch:
    """Waits for the store to grow; StoreError when its extraction seems to have died.

    `interrupt` (set by a one-rank training loop) is asked at each poll: a non-zero answer ends
    the wait with WaitInterrupted, so a run stopped while caught up with extraction need not
    wait for its next batch (with several ranks a peer may be inside the step's collectives:
    they stop after it)."""

    def __init__(self, store: str | Path, poll_s: float, timeout_s: float) -> None:
        self.store, self.poll_s, self.timeout_s = Path(store), poll_s, timeout_s
        self.interrupt: Callable[[], int] | None = None

    def _progress(self) -> tuple[bool, bool, int]:
        root = (self.store / "zarr.json").is_file()
        return root, (self.store / HEAD_FILE).is_file(), len(committed_shards(self.store))

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        """Return once `ready()`; log the wait, and raise when extraction stopped."""
        if ready():
            return
        log = get_logger()
        seen, since, warned = self._progress(), time.monotonic(), False
        held_at = since  # when the writer lock was last found held (a sign of life, as a shard)
        log.info(
            "caught up with extraction of %s: waiting for %s (%d shards committed), checking "
            "every %g s",
            self.store,
            what,
            seen[2],
            self.poll_s,
        )
        while not ready():
            time.sleep(self.poll_s)
            if self.interrupt is not None and (code := self.interrupt()):
                raise WaitInterrupted(code)
            if (now := self._progress()) != seen:
                seen, since, warned = now, time.monotonic(), False
                continue
            clock = time.monotonic()
            idle = clock - since
            if clock - max(since, held_at) < self.timeout_s:
                continue
            if not writer_lock_held(self.store):
                if not seen[0]:  # no store was ever created: nothing was started here
                    raise StoreError(
                        f"store {self.store}: no `dflash extract` has created it in {idle:.0f} s; "
                        "start `dflash extract --out` with this folder (train --follow waits for "
                        "it), check the --store path, or raise data.follow_timeout_s"
                    )
                raise StoreError(
                    f"store {self.store}: extraction seems to have stopped: nothing new for "
                    f"{idle:.0f} s ({seen[2]} shards committed, waiting for {what}) and no "
                    "`dflash extract` holds its writer lock; rerun the same `dflash extract` "
                    "command (it resumes), then this `dflash train --follow` command (it resumes "
                    "from its newest checkpoint), or raise data.follow_timeout_s"
                )
            # held: probed again only timeout_s from now, so that an extract killed and
            # restarted meanwhile (a requeued job; its restart loads the target before its next
            # shard) is found holding it, not taken for dead the first poll its lock is free
            held_at = clock
            if not warned:
                log.warning(
                    "no new shard in %s for %.0f s, but `dflash extract` still holds its writer "
                    "lock: still waiting",
                    self.store,
                    idle,
                )
                warned = True


def watch_for(cfg: TrainDataConfig) -> ExtractionWatch:
    return ExtractionWatch(cfg.store, cfg.follow_poll_s, cfg.follow_timeout_s)


def shard_ready(store: Path, index: int) -> bool:
    return (shards_dir(store) / shard_name(index)).is_dir()


def wait_for_store(cfg: TrainDataConfig) -> None:
    """Wait until the store has its root, head file and a first shard (what `check_inputs`
    reads): `dflash extract` creates them only after tokenizing and loading the target."""
    store = Path(cfg.store)

    def ready() -> bool:
        return (
            (store / "zarr.json").is_file()
            and (store / HEAD_FILE).is_file()
            and bool(committed_shards(store))  # not any(): shard 0 is index 0
        )

    watch_for(cfg).wait(ready, "its first shard")
    info = open_store(store)  # format and version first, with their own messages
    planned = info.num_shards * int(info.attrs["sequences_per_shard"])
    if planned <= cfg.holdout_sequences:
        raise StoreError(
            f"{store}: its plan holds at most {planned} sequences, which cannot spare "
            f"data.holdout_sequences={cfg.holdout_sequences} for evaluation and still train; "
            "lower it or extract more data"
        )


class FollowPlan:
    """Which sequences rank `rank` reads in a --follow run: epoch 0 streamed (see the module
    docstring), later epochs EpochPlan's shuffles. `steps_per_epoch` is the schedule's bound."""

    def __init__(
        self,
        info: StoreInfo,
        cfg: TrainDataConfig,
        world: int,
        rank: int,
        batch: int,
        accum: int,
    ) -> None:
        self.store, self.holdout, self.seed = info.path, cfg.holdout_sequences, cfg.seed
        self.world, self.rank, self.batch, self.accum = world, rank, batch, accum
        self.per_shard, self.num_shards = int(info.attrs["sequences_per_shard"]), info.num_shards
        self.per_step = world * batch * accum
        self.watch = watch_for(cfg)
        self.num_train = self.num_shards * self.per_shard - self.holdout  # an upper bound
        self.steps_per_epoch = -(-self.num_train // self.per_step)
        # positions below this are training sequences whatever the last shard holds (>= 1)
        self.surely_train = self.num_train - self.per_shard + 1
        self._split: SequenceSplit | None = None
        self._shuffled: EpochPlan | None = None
        self.content_key = info.attrs["content_key"]
        self._checked: set[int] = set()  # shards committed under this run's content key

    def committed(self, index: int) -> bool:
        """Whether shard `index` is committed, by the extraction this run began on: a store
        rewritten meanwhile (`dflash extract --overwrite` with other settings or data) raises,
        where its shards would have gone on the stream after those of the first. The new root
        is written before any of its shards, so a shard seen committed is checked against the
        root that was there when it was."""
        if index in self._checked:
            return True
        if not shard_ready(self.store, index):
            return False
        try:
            root = read_root_attrs(self.store)
        except StoreError:  # --overwrite between its deletion and the new root
            return False
        if root.get("content_key") != self.content_key:
            raise StoreError(
                f"store {self.store} was rewritten by a `dflash extract` with other settings or "
                "data (another content key) while this run followed it; its shards no longer "
                "continue the ones trained on: train on the new store with a new --out"
            )
        self._checked.add(index)
        return True

    def known_split(self) -> SequenceSplit | None:
        """The train / held-out split, once the last shard is committed (never waits)."""
        last = self.num_shards - 1
        if self._split is None and self.committed(last):
            meta = shards_dir(self.store) / shard_name(last) / "zarr.json"
            tail = int(json.loads(meta.read_text())["attributes"][SHARD_ATTR]["num_sequences"])
            total = last * self.per_shard + tail
            if total <= self.holdout:
                raise StoreError(
                    f"{self.store}: {total} sequences cannot spare data.holdout_sequences="
                    f"{self.holdout} for evaluation and still train; lower it"
                )
            self._split = SequenceSplit(total, self.holdout)
        return self._split

    def split(self) -> SequenceSplit:
        """The split, waiting for the last shard if it is not committed yet."""
        what = f"its last shard {self.num_shards - 1} (it places the held-out sequences)"
        self.watch.wait(lambda: self.known_split() is not None, what)
        assert self._split is not None
        return self._split

    def _is_train(self, pos: int) -> bool:
        return pos < self.surely_train or pos < self.split().num_train

    def epoch_done(self, epoch: int, steps_done: int) -> bool:
        """Whether `epoch` has no step past `steps_done` (may wait, in the streamed epoch)."""
        if epoch == 0:
            return not self._is_train(steps_done * self.per_step)
        return self.shuffled().epoch_done(epoch, steps_done)

    def streamed(self, steps_done: int) -> int:
        """Sequences [0, n) that `steps_done` steps of the streamed epoch consumed (all ranks)."""
        consumed, split = steps_done * self.per_step, self.known_split()
        return min(consumed, split.num_train) if split else consumed

    def shuffled(self) -> EpochPlan:
        if self._shuffled is None:
            args = (self.world, self.rank, self.batch, self.accum, self.seed)
            self._shuffled = EpochPlan(self.split().num_train, *args)
        return self._shuffled

    def _wait_for_step(self, step: int) -> None:
        """Wait until the shards of streamed step `step` are committed: those of every rank's
        sequences, not only this rank's. A rank waiting alone for its next shard (an extract
        shard's time, or data.follow_timeout_s when extraction died) would leave the others in
        the step's all-reduce meanwhile, under the process-group timeout (train.py); waiting for
        the same shards, the ranks reach that all-reduce within a poll of one another."""
        first = step * self.per_step
        train = [pos for pos in range(first, first + self.per_step) if self._is_train(pos)]
        for shard in sorted({pos // self.per_shard for pos in train}):
            self.watch.wait(lambda s=shard: self.committed(s), f"shard {shard}")

    def micro_batches(self, epoch: int, start_step: int = 0) -> Iterator[list[ItemKey]]:
        """This rank's micro-batches of `epoch` from step `start_step` on; in the streamed
        epoch a step's are yielded only once the shards of the whole step (all ranks') are
        committed."""
        if epoch > 0:
            yield from self.shuffled().micro_batches(epoch, start_step)
            return
        step = start_step
        while not self.epoch_done(0, step):
            self._wait_for_step(step)
            for m in range(self.accum):
                base = ((step * self.accum + m) * self.world + self.rank) * self.batch
                keys = []
                for pos in range(base, base + self.batch):
                    if self._is_train(pos):  # its shard is committed (_wait_for_step)
                        keys.append((pos, 0, False))
                    else:  # padding: a zero-weight copy of a sequence read earlier
                        keys.append((pos % self.split().num_train, 0, True))
                yield keys
            step += 1


class FollowHoldout(torch.utils.data.Sampler[list[ItemKey]]):
    """The held-out batches of a --follow run, available once their shards are committed."""

    def __init__(self, plan: FollowPlan, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.told = False  # the skipped evaluations are logged once

    def ready(self) -> bool:
        """Whether every held-out shard is committed, on every rank (evaluation is collective;
        ranks must agree even when a shard commits between their looks)."""
        split = self.plan.known_split() if self.plan.holdout else None
        first = split.num_train // self.plan.per_shard if split else self.plan.num_shards
        ok = split is not None and all(
            self.plan.committed(i) for i in range(first, self.plan.num_shards)
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(ok)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        if not ok and self.plan.holdout and not self.told:
            get_logger().info(
                "held-out evaluation is skipped until extraction commits the store's last "
                "shards: the %d held-out sequences are its last ones",
                self.plan.holdout,
            )
            self.told = True
        return ok

    def _batches(self) -> HoldoutSampler:
        plan = self.plan
        return HoldoutSampler(plan.split(), plan.world, plan.rank, plan.batch)

    def __iter__(self) -> Iterator[list[ItemKey]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def check_stream_position(state: TrainState, plan: EpochPlan | FollowPlan) -> None:
    """Refuse to go on with epoch 0 in another order than it began (a resume with or without
    --follow and --allow-config-change); a fresh epoch 0 takes this run's order."""
    follow = isinstance(plan, FollowPlan)
    if state.epoch == 0 and state.step_in_epoch == 0:
        state.stream = follow
    elif state.epoch == 0 and state.stream != follow:
        began, flag = ("streamed", "with") if state.stream else ("shuffled", "without")
        raise ValueError(
            f"the checkpoint's epoch 0 was {began} and is not finished: resume it {flag} "
            "--follow (data.follow), or pass a new --out"
        )
    elif follow and state.epoch == 0:
        assert state.streamed_sequences == plan.streamed(state.step_in_epoch), state
