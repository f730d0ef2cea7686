"""Two ends of a failure_shared section (common/distributed.py) that a rank leaves without
meeting the others, past the interrupt between two units of work that
test_review_extract_rank_failure and test_review_generate_rank_failure cover:

- a rank already waiting in the meeting when another is interrupted (Ctrl-C) learns it from
  the broken collective and ends with that rank's word, `Stopped` (exit 130), not gloo's
  "Connection closed by peer";
- a rank whose store is gone (its host, torchrun's first node, stopped) stops at its next unit
  of work, named, where `another_rank_failed` raised the store's DistNetworkError
  ("Broken pipe", measured under two `torchrun --nnodes 2` on one host).

Two gloo ranks in processes of their own (a rank's exit is what the other must see)."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from test_review_rank0_sections import _run_ranks, _wait_for

from common.distributed import _free_port

TIMEOUT = timedelta(seconds=20)  # a regression fails in seconds, not at torch's default


def _outcome(body: Any) -> str:
    try:
        body()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "none"


def _meeting_rank(rank: int, root: Path, seen: Any) -> None:
    import torch.distributed as dist

    import common.distributed as distributed

    store = dist.FileStore(str(root / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    if rank == 1:  # interrupted once rank 0 waits in the meeting, then its process ends
        try:
            with distributed.failure_shared():
                _wait_for(root / "meeting")
                time.sleep(0.5)  # rank 0 into the collective (either way it must end so)
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            os._exit(0)
    gather = distributed.gather_from_all_ranks

    def meet(value: Any) -> list[Any]:
        (root / "meeting").touch()
        return gather(value)

    distributed.gather_from_all_ranks = meet

    def section() -> None:
        with distributed.failure_shared():
            pass

    seen.put((rank, _outcome(section)))


def test_a_rank_waiting_in_the_meeting_learns_of_an_interrupt(tmp_path: Path) -> None:
    # rank 1 is gone (its process ends): a pair of processes of their own
    told = _run_ranks(_meeting_rank, tmp_path, reports=1, own_processes=True)[0]
    assert told.startswith("Stopped: rank 1 was interrupted (Ctrl-C, SIGINT)"), told
    assert "rerun the same command to resume" in told


def _store_rank(rank: int, root: Path, port: int, seen: Any) -> None:
    import torch.distributed as dist

    import common.distributed as distributed

    # rank 0 hosts the store, as torchrun's first node does for every rank
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    if rank == 0:  # gone, store and all, once rank 1 works through its share
        _wait_for(root / "working")
        os._exit(1)
    units = []

    def section() -> None:
        with distributed.failure_shared():
            for unit in range(1000):
                if distributed.another_rank_failed():
                    break
                units.append(unit)
                (root / "working").touch()
                time.sleep(0.01)

    told = _outcome(section)
    seen.put((rank, f"{told} ({len(units)} units)"))


def test_a_lost_store_ends_the_section_at_the_next_unit(tmp_path: Path) -> None:
    # rank 0 is gone (its process ends): a pair of processes of their own
    told = _run_ranks(_store_rank, tmp_path, _free_port(), reports=1, own_processes=True)[1]
    assert told.startswith("RankFailed: the ranks could not meet (DistNetworkError"), told
    assert "torchrun's first node (the store's host) stopped" in told
    assert "(1000 units)" not in told  # stopped at its next unit, not after all of them


def test_a_store_that_fails_a_look_up_never_ends_a_share_as_done(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A look-up the store cannot answer raises, named: a rank that only stopped its share
    there (the look-up read as 'another rank failed') met the others with nothing to say once
    the store answered again, and its section ended as if its work were done."""
    import pytest
    import torch.distributed as dist

    import common.distributed as distributed

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=TIMEOUT)
    try:
        real, failed = distributed._group_store(), []

        class Hiccup:  # one look-up fails (a lost packet, a slow host), then all is well again
            def __getattr__(self, name: str) -> Any:
                if name == "check" and not failed:
                    failed.append(name)

                    def fail(*args: Any) -> None:
                        raise dist.DistNetworkError("Broken pipe")

                    return fail
                return getattr(real, name)

        units = []
        lost = pytest.raises(distributed.RankFailed, match="the ranks could not meet")
        with lost, distributed.failure_shared():
            monkeypatch.setattr(distributed, "_group_store", Hiccup)
            for unit in range(5):
                if distributed.another_rank_failed():
                    break
                units.append(unit)
        assert units == []
    finally:
        dist.destroy_process_group()
