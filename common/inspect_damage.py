"""Shard bytes that no longer decode, or are not there: zarr raises many exception types for
the first, and reads the second (an empty or absent data file) as zeros without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zarr

REEXTRACT = "re-extract it: delete the shard folder and rerun the same `dflash extract` command"


class Undecodable(Exception):
    """An array of the shard whose stored bytes cannot be read back; ends that shard's check."""

    def __init__(self, array: str, err: Exception) -> None:
        super().__init__(array, err)
        self.array, self.err = array, err


def read_array(array: zarr.Array, selection: Any) -> np.ndarray:
    """`array[selection]`, a decode failure raised as `Undecodable` naming the array."""
    try:
        return array[selection]
    except Exception as err:  # checksum, codec and short-file errors come as many types
        raise Undecodable(array.basename, err) from err


# arrays that are never all zeros in a shard, so their data file always exists (not
# topk_logits or logsumexp: a store imported without verifier outputs holds a one-hot top-1
# with logit 0 and log-sum-exp 0, written as no file at all)
ALWAYS_STORED = ("tokens", "hidden", "hidden_scale", "position_ids", "topk_ids", "target_argmax")


def missing_bytes(array_dir: Path, name: str) -> str | None:
    """A data file that is empty, or absent where it must exist: zarr reads either as the
    fill value without an error. (An array whose chunks all equal the fill value may legitimately
    have no file, hence the check of absence only for ALWAYS_STORED.)"""
    chunks = array_dir / "c"
    files = [p for p in chunks.rglob("*") if p.is_file()] if chunks.is_dir() else []
    if empty := [p for p in files if p.stat().st_size == 0]:
        return f"empty data file {empty[0].relative_to(array_dir)}"
    if not files and name in ALWAYS_STORED:
        return "no data file"
    return None
