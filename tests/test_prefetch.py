"""The device prefetcher hands the loop the same micro-batches in the same order as pulling
them at the top of each step, and raises what the pull raised where the loop expects it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from stage2_train.prefetch import DevicePrefetcher

CPU = torch.device("cpu")


def steps_through(items: list[int], micro: int, prefetch: bool) -> list[list[int]]:
    it = iter(items)
    prefetcher = DevicePrefetcher(CPU, micro)
    out = []
    for _ in range(len(items) // micro):
        out.append(prefetcher.take(it))
        if prefetch:
            prefetcher.fetch(it)
    return out


@pytest.mark.parametrize("micro", [1, 3])
def test_same_batches_in_the_same_order(micro: int) -> None:
    items = list(range(12))
    assert steps_through(items, micro, True) == steps_through(items, micro, False)
    assert [b for step in steps_through(items, micro, True) for b in step] == items


def test_end_of_the_iterator_leaves_nothing_fetched() -> None:
    it = iter([1, 2])
    prefetcher = DevicePrefetcher(CPU, 2)
    assert prefetcher.take(it) == [1, 2]
    prefetcher.fetch(it)  # the iterator is over: nothing held, nothing raised
    assert prefetcher.ready is None and prefetcher.error is None
    with pytest.raises(StopIteration):
        prefetcher.take(it)


def test_an_error_while_fetching_is_raised_by_the_next_take() -> None:
    def items() -> Iterator[int]:
        yield 1
        raise OSError("shard 7: damaged chunk")

    it = items()
    prefetcher = DevicePrefetcher(CPU, 1)
    assert prefetcher.take(it) == [1]
    prefetcher.fetch(it)  # the step that is running is not interrupted
    with pytest.raises(OSError, match="shard 7"):
        prefetcher.take(it)


def test_a_loader_ending_inside_a_step_is_named() -> None:
    it = iter([1, 2, 3])
    prefetcher = DevicePrefetcher(CPU, 2)
    assert prefetcher.take(it) == [1, 2]
    prefetcher.fetch(it)
    with pytest.raises(RuntimeError, match="1 of a step's 2 micro-batches"):
        prefetcher.take(it)
