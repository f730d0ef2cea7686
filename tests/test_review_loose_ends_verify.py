"""`dflash inspect verify` on an nvfp4 store: a block scale byte with its sign bit set.

The encoder's block scale is amax / 6 / scale, never negative (nor -0.0), so such a byte is
damage; it decodes as finite values (its block's 16 values flipped in sign, or zeroed for
0x80), which the NaN check alone let through.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from store_factory import FactorySpec, build_store

from common.inspect_verify import verify_store

SHARD1 = Path("shards") / "shard-000001"


@pytest.mark.parametrize("byte", [0xFE, 0x80], ids=["minus_448", "minus_zero"])
def test_verify_names_a_negative_block_scale_and_its_shard(tmp_path: Path, byte: int) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=6, hidden_dtype="nvfp4"))
    assert verify_store(store)["ok"]
    hidden = zarr.open_array(str(store / SHARD1 / "hidden"), mode="r+")
    real = np.argwhere(zarr.open_array(str(store / SHARD1 / "document_ids"))[...] >= 0)
    seq, tok = (int(v) for v in real[-1])
    codes = hidden.shape[-1] * 8 // 9  # D / 2 bytes of codes, then D / 16 block scales
    row = hidden[seq, tok, 1]
    assert not (row[codes:] & 0x80).any()  # the encoder wrote no sign bit
    row[codes + 1] = byte
    hidden[seq, tok, 1] = row
    problems = verify_store(store)["problems"]
    assert [(p["shard"], p["array"]) for p in problems] == [("shard-000001", "hidden")]
    assert problems[0]["problem"] == (
        "1 negative block scales (sign bit set; the encoder writes none) "
        f"(first at sequence {seq}, token {tok})"
    )


def test_a_nan_block_scale_is_named_once_not_as_negative_too(tmp_path: Path) -> None:
    """0xFF is an e4m3 NaN with its sign bit set: the NaN check names it, the sign check not."""
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=6, hidden_dtype="nvfp4"))
    hidden = zarr.open_array(str(store / SHARD1 / "hidden"), mode="r+")
    real = np.argwhere(zarr.open_array(str(store / SHARD1 / "document_ids"))[...] >= 0)
    seq, tok = (int(v) for v in real[0])
    codes = hidden.shape[-1] * 8 // 9
    row = hidden[seq, tok, 0]
    row[codes] = 0xFF
    hidden[seq, tok, 0] = row
    problems = verify_store(store)["problems"]
    assert [p["problem"].split(" (")[0] for p in problems] == ["1 NaN/Inf values"]
