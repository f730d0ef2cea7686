"""What one loader worker spends building a training batch from a real store, stage by stage,
timed inside a real DataLoader worker process (one thread, as the trainer's are): the rows'
decode (read), the items (anchors, labels, the distillation gathers), collate (layout, then
the attention-mask tables at full or narrow width) and the hand-over of the batch to the
training process (ship: pickling it for the worker's queue, which moves every tensor not
already there into shared memory). A worker builds a whole batch, so
`num_workers / batch_narrow_ms` bounds the batches a second the loader can feed; the step
needs `1 / step_s`. One JSON line per batch size on stdout, medians over the timed batches:

    python bench/loader_cost.py --store STORE                 # 8 and 16 sequences a batch
    python bench/loader_cost.py --store STORE --sequences 16 --batches 4 --repeats 3
    python bench/loader_cost.py --store STORE --clock cpu     # the worker's CPU time instead

`--clock cpu` counts the worker process's CPU seconds (all its threads: zarr decodes on its
own) instead of wall time: steadier on a busy machine, and what the cores pay.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from common.store import open_store
from stage2_train.data import StoreSequences, collate
from stage2_train.masks import TILE

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
STAGES = ("read_ms", "item_ms", "collate_ms", "tables_full_ms", "tables_narrow_ms", "ship_ms")


class TimedReads(StoreSequences):
    """StoreSequences that adds up the time of its rows' reads (decode) apart from the rest."""

    read_s = 0.0
    clock = staticmethod(time.perf_counter)

    def _read(self, index: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
        started = self.clock()
        rows = super()._read(index, *args, **kwargs)
        self.read_s += self.clock() - started
        return rows


def _items(data: TimedReads, keys: list[tuple[int, int, bool]]) -> list[dict[str, Any]]:
    """The items of `keys` as the DataLoader's fetcher gets them (__getitems__ where defined)."""
    if callable(getattr(data, "__getitems__", None)):
        return data.__getitems__(keys)
    return [data[key] for key in keys]


def batch_costs(data: TimedReads, keys: list[tuple[int, int, bool]]) -> dict[str, float]:
    """Milliseconds of one batch's stages: read, item (without the read), collate without
    tables, the tables at full and narrow width (collate's extra over no tables), and the
    pickling of the (narrow) batch for the worker's queue."""
    clock = data.clock
    data.read_s = 0.0
    started = clock()
    items = _items(data, keys)
    items_s = clock() - started
    timings = {"read_ms": data.read_s * 1e3, "item_ms": (items_s - data.read_s) * 1e3}
    for name, kwargs in (
        ("collate_ms", {"mask_tables": False}),
        ("tables_full_ms", {"narrow": False}),
        ("tables_narrow_ms", {"narrow": True}),
    ):
        started = clock()
        batch = collate(items, **kwargs)
        timings[name] = (clock() - started) * 1e3
    timings["tables_full_ms"] -= timings["collate_ms"]
    timings["tables_narrow_ms"] -= timings["collate_ms"]
    started = clock()
    ForkingPickler.dumps(batch, pickle.HIGHEST_PROTOCOL)  # as the worker's queue feeder does
    timings["ship_ms"] = (clock() - started) * 1e3
    return timings


class Costs(torch.utils.data.Dataset):
    """A dataset whose "batch" is the stage timings of building a batch of `data`'s keys."""

    def __init__(self, data: TimedReads) -> None:
        self.data = data

    def __getitems__(self, keys: list[tuple[int, int, bool]]) -> list[dict[str, float]]:
        return [batch_costs(self.data, keys)]


def _first(rows: list[dict[str, float]]) -> dict[str, float]:
    return rows[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--sequences", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--batches", type=int, default=3, help="batches timed per size")
    parser.add_argument("--repeats", type=int, default=1, help="passes over those batches")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    parser.add_argument("--no-distill", action="store_true", help="skip the top-k arrays")
    args = parser.parse_args()
    info = open_store(args.store, require_complete=True)
    data = TimedReads(
        info,
        num_anchors=args.anchors,
        per_document=False,
        block_size=args.block_size,
        label_target="target",
        distill=not args.no_distill,
        seed=0,
    )
    data.clock = CLOCKS[args.clock]
    count = int(info.attrs["counts"]["sequences"])
    for size in args.sequences:

        def keys(b: int, size: int = size) -> list[tuple[int, int, bool]]:
            return [((b * size + i) % count, 0, False) for i in range(size)]

        timed = [keys(b) for _ in range(args.repeats) for b in range(1, args.batches + 1)]
        batches = [keys(0), *timed]  # the first batch opens shards: not timed
        loader = torch.utils.data.DataLoader(
            Costs(data), batch_sampler=batches, num_workers=1, collate_fn=_first
        )
        rows = list(loader)[1:]
        record = {k: round(statistics.median(r[k] for r in rows), 1) for k in STAGES}
        common = record["read_ms"] + record["item_ms"] + record["collate_ms"] + record["ship_ms"]
        record["batch_full_ms"] = round(common + record["tables_full_ms"])
        record["batch_narrow_ms"] = round(common + record["tables_narrow_ms"])
        print(
            json.dumps({"sequences": size, "tile": TILE, "clock": args.clock, **record}), flush=True
        )


if __name__ == "__main__":
    main()
