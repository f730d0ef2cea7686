"""How much of flex's tile work the anchor-block mask needs, per tile size (CPU, no timing).

flex_attention runs every tile of its BlockMask's lists, a full tile at the kernel's pace and a
partial one with the mask_mod applied to each element; the visible elements are all it has to
compute. For square tiles of 16-128 tokens this counts, from the project's own tables
(`masks.anchor_mask_tables`), the tiles run (full and partial, in the context and in the blocks'
own keys) against the grid, and the visible elements against the elements of those tiles
(`visible_of_run`). A kernel that ran only visible elements at a full tile's pace would take
`visible_of_run` of the time of one that runs every tile at that pace: the floor sparsity alone
can buy at a tile size (issue 12's attention goal is judged against it in BENCHMARKS.md).

Shapes: `seed`, bench_attention's (128 anchors x 16 over 8,192 context tokens in 8
documents), and `recipe`, mask_tables.py's loader batch (16 sequences of 3,072 tokens, 512
anchors each). One JSON line per shape and tile on stdout, and in $OUT/mask_work.jsonl:

    python bench/mask_work.py                        # both shapes, tiles 16 32 64 128
    python bench/mask_work.py --shape seed --tiles 64
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import Tensor

from stage2_train.data import collate
from stage2_train.masks import anchor_mask_tables, context_intervals


def seed_shape() -> tuple[Tensor, Tensor, int]:
    """(ctx_lo_A, ctx_hi_A, context length) of bench_attention's seed shape."""
    import bench_attention  # bench/ is on sys.path: scripts run as bench/x.py

    anchors_A, document_ids_S, *_ = bench_attention.inputs("cpu", torch.float32)
    lo_A, hi_A = context_intervals(anchors_A, document_ids_S)
    return lo_A, hi_A, document_ids_S.numel()


def recipe_shape(num_seqs: int = 16) -> tuple[Tensor, Tensor, int]:
    """(ctx_lo_A, ctx_hi_A, context length) of mask_tables.py's loader batch."""
    import mask_tables

    gen = torch.Generator().manual_seed(0)
    batch = collate([mask_tables.item(gen) for _ in range(num_seqs)], mask_tables=False)
    lo_A, hi_A = context_intervals(batch.anchors_A, batch.document_ids_T)
    return lo_A, hi_A, batch.document_ids_T.numel()


def tile_work(lo_A: Tensor, hi_A: Tensor, context_len: int, block_size: int, tile: int) -> dict:
    """Tiles run and visible elements of the anchor-block mask at square `tile`-token tiles."""
    tables = anchor_mask_tables(lo_A, hi_A, context_len, block_size, tile)
    q_tiles, kv_tiles = (
        tables.kv_indices.shape[-2],
        -(-(context_len + lo_A.numel() * block_size) // tile),
    )
    first_own = context_len // tile  # tiles at or past it hold the blocks' own keys
    counts = {"full_ctx": 0, "partial_ctx": 0, "full_own": 0, "partial_own": 0}
    for kind, num, idx in (
        ("partial", tables.kv_num_blocks, tables.kv_indices),
        ("full", tables.full_kv_num_blocks, tables.full_kv_indices),
    ):
        num_Q, idx_QK = num[0, 0], idx[0, 0]
        listed = torch.arange(idx_QK.shape[-1]) < num_Q[:, None]  # the listed prefix of each row
        own = (idx_QK >= first_own) & listed
        counts[f"{kind}_own"] = int(own.sum())
        counts[f"{kind}_ctx"] = int(listed.sum()) - counts[f"{kind}_own"]
    run = sum(counts.values())
    # each block's B rows see its context interval and its own B keys (padding blocks too:
    # their interval is empty, their own block is not)
    visible = block_size * int((hi_A - lo_A).clamp(min=0).sum()) + lo_A.numel() * block_size**2
    return {
        "tile": tile,
        "grid_tiles": q_tiles * kv_tiles,
        **counts,
        "run_pct": round(100 * run / (q_tiles * kv_tiles), 2),
        "visible_pct": round(100 * visible / (lo_A.numel() * block_size * (kv_tiles * tile)), 2),
        "visible_of_run": round(visible / (run * tile * tile), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["seed", "recipe", "both"], default="both")
    parser.add_argument("--tiles", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    shapes = {"seed": seed_shape, "recipe": recipe_shape}
    names = list(shapes) if args.shape == "both" else [args.shape]
    out = os.environ.get("OUT")
    for name in names:
        lo_A, hi_A, context_len = shapes[name]()
        for tile in args.tiles:
            record = {
                "what": "mask_work",
                "shape": name,
                "anchors": lo_A.numel(),
                "context_len": context_len,
            }
            record.update(tile_work(lo_A, hi_A, context_len, args.block_size, tile))
            line = json.dumps(record)
            print(line, flush=True)
            if out:
                os.makedirs(out, exist_ok=True)
                with open(os.path.join(out, "mask_work.jsonl"), "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
