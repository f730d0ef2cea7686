"""`dflash train --follow` against what an impatient user does to the extraction it follows: a
store rewritten under it with other settings (`dflash extract --overwrite`), and an extract
killed and restarted after it had been slow (its lock seen held past data.follow_timeout_s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_follow import REAL_SLEEP, data_cfg, store_being_extracted

import stage2_train.follow as follow
from common.store import StoreError, open_store, shard_name, shards_dir
from stage2_train.follow import ExtractionWatch, FollowHoldout, FollowPlan


def test_a_store_rewritten_with_other_settings_stops_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards 0-2 streamed, then the store is rewritten by an extract with other data (another
    content key) whose shards 3-4 commit: the stream stops with an error naming the rewrite
    instead of training on them after the first store's shards (in the measured run they
    streamed on silently, and epoch 1 failed later on a shard's changed file sizes, as damage);
    held-out evaluation never reads the new shards either."""
    store, aside, _ = store_being_extracted(tmp_path)
    plan = FollowPlan(open_store(store), data_cfg(store), 1, 0, 1, 1)
    holdout = FollowHoldout(plan, device=None)

    def rewritten(_seconds: float) -> None:  # what --overwrite with other data leaves
        meta = store / "zarr.json"
        doc = json.loads(meta.read_text())
        doc["attributes"]["dflash"]["content_key"] = "another"
        meta.write_text(json.dumps(doc))
        for index in (3, 4):
            (aside / shard_name(index)).rename(shards_dir(store) / shard_name(index))

    monkeypatch.setattr(follow.time, "sleep", rewritten)
    streamed = []
    with pytest.raises(StoreError, match="rewritten by a `dflash extract` with other settings"):
        for keys in plan.micro_batches(0):
            streamed += [index for index, _, _ in keys]
    assert streamed == list(range(9))  # shards 0-2 of the store it began on, nothing after
    with pytest.raises(StoreError, match="rewritten"):
        holdout.ready()


def test_an_extract_restarted_after_a_slow_shard_keeps_the_run_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extraction slow past data.follow_timeout_s (its lock found held: still waiting), then
    killed and restarted (its lock free for a few polls, then held again), then its shard: the
    run waits on and returns. Before, the first poll that found the lock free raised at once,
    the last shard being older than the timeout, however soon the restart came. A lock free at
    a look timeout_s after the last sign of extraction still raises."""
    store, aside, _ = store_being_extracted(tmp_path)
    shard = shards_dir(store) / shard_name(3)
    probes: list[bool] = []  # what each look at the writer lock found
    after_first: list[int] = []  # polls since the first look

    def held() -> bool:  # killed the poll after the first look, restarted three polls later
        return not 1 <= len(after_first) <= 3

    def probe(_store: Path) -> bool:
        probes.append(held())
        return probes[-1]

    def poll(seconds: float) -> None:
        REAL_SLEEP(seconds)
        if probes:
            after_first.append(1)
        if len(probes) == 2 and not shard.is_dir():  # found held again: its shard commits
            (aside / shard_name(3)).rename(shard)

    monkeypatch.setattr(follow.time, "sleep", poll)
    monkeypatch.setattr(follow, "writer_lock_held", probe)
    watch = ExtractionWatch(store, poll_s=0.01, timeout_s=0.5)
    watch.wait(shard.is_dir, "shard 3")
    assert probes == [True, True] and len(after_first) > 3  # it waited past the restart
    # never restarted: the look timeout_s after the lock was last seen held finds it free
    probes.clear()
    monkeypatch.setattr(follow, "writer_lock_held", lambda _store: probes.append(False) or False)
    with pytest.raises(StoreError, match="extraction seems to have stopped.*shard 4"):
        watch.wait((shards_dir(store) / shard_name(4)).is_dir, "shard 4")
    assert probes == [False]
