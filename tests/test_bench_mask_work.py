"""bench/mask_work.py's counts against a dense anchor-block mask built element by element here:
the tiles that hold a visible element, those wholly visible, and the visible elements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from mask_work import tile_work  # noqa: E402


def dense_mask(lo: list[int], hi: list[int], context_len: int, block: int) -> np.ndarray:
    """[A*B, context + A*B]: row r of block a sees keys [lo_a, hi_a) and its own B keys."""
    n_blocks = len(lo)
    mask = np.zeros((n_blocks * block, context_len + n_blocks * block), dtype=bool)
    for a in range(n_blocks):
        for r in range(a * block, (a + 1) * block):
            for key in range(lo[a], hi[a]):
                mask[r, key] = True
            for key in range(context_len + a * block, context_len + (a + 1) * block):
                mask[r, key] = True
    return mask


@pytest.mark.parametrize("tile", [16, 32, 64])
def test_tile_work_counts_what_a_dense_mask_holds(tile: int) -> None:
    rng = np.random.default_rng(tile)
    context_len, block, n_blocks = 256, 16, 12
    doc_starts = [0, 70, 150]  # three documents; an anchor sees its document up to itself
    anchors = sorted(rng.choice(np.arange(1, context_len), size=n_blocks - 2, replace=False))
    lo = [max(s for s in doc_starts if s <= a) for a in anchors] + [0, 0]
    hi = [int(a) for a in anchors] + [0, 0]  # two padding blocks: empty intervals
    work = tile_work(
        torch.tensor(lo, dtype=torch.int32),
        torch.tensor(hi, dtype=torch.int32),
        context_len,
        block,
        tile,
    )
    mask = dense_mask(lo, hi, context_len, block)
    rows, cols = mask.shape
    padded = np.zeros((-(-rows // tile) * tile, -(-cols // tile) * tile), dtype=bool)
    padded[:rows, :cols] = mask
    tiles = padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile)
    visible_QK = tiles.sum(axis=(1, 3))
    full_QK = visible_QK == tile * tile
    touched_QK = visible_QK > 0
    own_K = np.arange(tiles.shape[2]) >= context_len // tile
    assert work["full_ctx"] + work["full_own"] == int(full_QK.sum())
    assert work["full_own"] == int(full_QK[:, own_K].sum())
    assert work["partial_ctx"] == int((touched_QK & ~full_QK)[:, ~own_K].sum())
    assert work["partial_own"] == int((touched_QK & ~full_QK)[:, own_K].sum())
    assert work["grid_tiles"] == tiles.shape[0] * tiles.shape[2]
    assert work["visible_of_run"] == pytest.approx(
        mask.sum() / (touched_QK.sum() * tile * tile), abs=1e-4
    )


def test_the_script_reports_each_tile_of_the_seed_shape(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mask_work.py"), "--shape", "seed", "--tiles", "64"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = [json.loads(line) for line in (tmp_path / "mask_work.jsonl").open()]
    assert record["shape"] == "seed" and record["tile"] == 64
    # the seed shape is fixed (seeded): 8.3% of the keys visible, the 64-token tiles run more
    assert record["visible_pct"] == pytest.approx(8.31, abs=0.01)
    assert record["run_pct"] > record["visible_pct"]
    assert 0 < record["visible_of_run"] < 1
