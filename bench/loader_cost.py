"""What one loader worker spends building a training batch from a real store, stage by stage,
on one thread: the rows' decode (zarr + zstd), the item (anchors, labels, the distillation
gathers), and collate (layout, then the attention-mask tables at full or narrow width).
A worker builds a whole batch, so `num_workers / batch_ms` bounds the batches a second the
loader can feed; the step needs `1 / step_s`. One JSON line per batch size on stdout:

    python bench/loader_cost.py --store STORE                 # 8 and 16 sequences a batch
    python bench/loader_cost.py --store STORE --sequences 16 --batches 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from common.store import open_store
from stage2_train.data import StoreSequences, collate
from stage2_train.masks import TILE


class TimedReads(StoreSequences):
    """StoreSequences that adds up the time of its rows' reads (decode) apart from the rest."""

    read_s = 0.0

    def _read(self, index: int) -> dict[str, Any]:
        started = time.perf_counter()
        rows = super()._read(index)
        self.read_s += time.perf_counter() - started
        return rows


def batch_costs(data: TimedReads, indices: list[int]) -> dict[str, float]:
    """Milliseconds of one batch's stages: read, item (without the read), collate without
    tables, and the tables at full and narrow width (collate's extra over no tables)."""
    data.read_s = 0.0
    started = time.perf_counter()
    items = [data[(index, 0, False)] for index in indices]
    items_s = time.perf_counter() - started
    timings = {"read_ms": data.read_s * 1e3, "item_ms": (items_s - data.read_s) * 1e3}
    for name, kwargs in (
        ("collate_ms", {"mask_tables": False}),
        ("tables_full_ms", {"narrow": False}),
        ("tables_narrow_ms", {"narrow": True}),
    ):
        started = time.perf_counter()
        collate(items, **kwargs)
        timings[name] = (time.perf_counter() - started) * 1e3
    timings["tables_full_ms"] -= timings["collate_ms"]
    timings["tables_narrow_ms"] -= timings["collate_ms"]
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--sequences", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--batches", type=int, default=3, help="batches timed per size")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-distill", action="store_true", help="skip the top-k arrays")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a DataLoader worker
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
    count = int(info.attrs["counts"]["sequences"])
    for size in args.sequences:
        rows = []
        for b in range(args.batches + 1):  # the first batch opens shards: not timed
            indices = [(b * size + i) % count for i in range(size)]
            rows.append(batch_costs(data, indices))
        rows = rows[1:]
        record = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        record["batch_full_ms"] = round(
            record["read_ms"] + record["item_ms"] + record["collate_ms"] + record["tables_full_ms"]
        )
        record["batch_narrow_ms"] = round(
            record["batch_full_ms"] - record["tables_full_ms"] + record["tables_narrow_ms"]
        )
        print(json.dumps({"sequences": size, "tile": TILE, **record}), flush=True)


if __name__ == "__main__":
    main()
