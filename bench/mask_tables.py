"""CPU cost of one batch's attention-mask tables as the loader's workers build them (collate):
build time on one thread and bytes, full [QT, KT] index lists against narrow ones
(`mask_widths.narrow_widths`, the default), at the recipe's shape (sequences of 3,072
tokens packing documents of 1/8 to 3/10 of a sequence, 512 anchors of 16 each). One JSON
line per batch size on stdout:

    python bench/mask_tables.py                      # 8 and 16 sequences, 64-token tiles
    python bench/mask_tables.py --sequences 8 --tile 128
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stage2_train.anchors import pad_anchors, sample_anchors
from stage2_train.data import collate
from stage2_train.mask_widths import narrow_widths
from stage2_train.masks import MaskTables, anchor_mask_tables, context_intervals

SEQ_LEN, ANCHORS, BLOCK = 3072, 512, 16


def item(gen: torch.Generator) -> dict:
    """One loader item: packed documents (the tail left as padding), sampled anchors."""
    docs_S = torch.full((SEQ_LEN,), -1, dtype=torch.long)
    start, doc = 0, 0
    while SEQ_LEN - start >= SEQ_LEN // 8:
        length = min(
            int(torch.randint(SEQ_LEN // 8, SEQ_LEN * 3 // 10, (), generator=gen)), SEQ_LEN - start
        )
        docs_S[start : start + length] = doc
        start, doc = start + length, doc + 1
    anchors_A = sample_anchors(docs_S >= 0, docs_S, ANCHORS, gen)
    return {
        "index": 0,
        "tokens_S": torch.zeros(SEQ_LEN, dtype=torch.long),
        "position_ids_S": torch.zeros(SEQ_LEN, dtype=torch.long),
        "document_ids_S": docs_S,
        "hidden_SKD": torch.zeros(SEQ_LEN, 1, 1),
        "anchors_A": pad_anchors(anchors_A, ANCHORS),
        "labels_AB": torch.zeros(ANCHORS, BLOCK, dtype=torch.long),
        "weights_AB": torch.zeros(ANCHORS, BLOCK),
    }


def table_bytes(tables: MaskTables) -> int:
    return sum(t.numel() * t.element_size() for t in tables)


def median_ms(builds: dict, repeats: int) -> dict[str, float]:
    """Median time of each build, the builds interleaved so that drift hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(repeats):
        for name, build in builds.items():
            started = time.perf_counter()
            build()
            times[name].append(time.perf_counter() - started)
    return {f"{name}_ms": round(1e3 * sorted(t)[len(t) // 2], 2) for name, t in times.items()}


def measure(num_seqs: int, tile: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    batch = collate([item(gen) for _ in range(num_seqs)], mask_tables=False)
    lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
    ctx = batch.document_ids_T.numel()
    started = time.perf_counter()
    widths = narrow_widths(num_seqs, SEQ_LEN, ANCHORS, BLOCK, tile)
    widths_ms = round(1e3 * (time.perf_counter() - started), 2)  # once per process (cached)
    full = anchor_mask_tables(lo_A, hi_A, ctx, BLOCK, tile)
    narrow = anchor_mask_tables(lo_A, hi_A, ctx, BLOCK, tile, widths=widths)
    return {
        "what": "mask_tables",
        "sequences": num_seqs,
        "tile": tile,
        "grid": list(full.kv_indices.shape[-2:]),
        "widths": list(widths),
        "busiest_rows": [
            int((full.kv_num_blocks + full.full_kv_num_blocks).max()),
            int((full.q_num_blocks + full.full_q_num_blocks).max()),
        ],
        "full_mb": round(table_bytes(full) / 1e6, 2),
        "narrow_mb": round(table_bytes(narrow) / 1e6, 2),
        **median_ms(
            {
                "full": lambda: anchor_mask_tables(lo_A, hi_A, ctx, BLOCK, tile),
                "narrow": lambda: anchor_mask_tables(lo_A, hi_A, ctx, BLOCK, tile, widths=widths),
            },
            repeats,
        ),
        "widths_ms_once": widths_ms,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--tile", type=int, default=64, choices=[64, 128])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a loader worker's share of the host
    for num_seqs in args.sequences:
        print(json.dumps(measure(num_seqs, args.tile, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
