"""`dflash convert STORE OUT.h5 --hidden-as float16` turned decoded values beyond float16's range
(+-65504: bf16 and scaled fp8 reach far past it) into inf without a word (helper-98's
walkthrough). Such an export is now refused naming the array and the fix; float32 keeps them."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zarr
from store_factory import FactorySpec, build_store
from test_convert import convert

from common.store import bf16_to_bits
from common.store_files import record_shard_files


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float8_e4m3fn"])
def test_float16_refuses_values_it_cannot_hold(tmp_path: Path, hidden_dtype: str) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=4, hidden_dtype=hidden_dtype))
    shard = store / "shards" / "shard-000000"
    group = zarr.open_group(shard, mode="r+")
    if hidden_dtype == "bfloat16":
        hidden = group["hidden"][...]
        hidden[0, 0, 0, 0] = bf16_to_bits(torch.tensor([1.0e5], dtype=torch.bfloat16))[0]
        group["hidden"][...] = hidden
    else:  # the row's scale: 448 (the fp8 maximum) x 300 is past 65504
        scale = group["hidden_scale"][...]
        scale[0, 0, 0] = 300.0
        group["hidden_scale"][...] = scale
    record_shard_files(shard)
    code, out = convert(store, tmp_path / "f16.h5", "--hidden-as", "float16")
    message = " ".join(out.split())
    assert code == 2, out
    assert "--hidden-as float16: shard-000000 array hidden holds" in message
    assert "export with --hidden-as float32" in message
    assert not (tmp_path / "f16.h5").exists()
    code, out = convert(store, tmp_path / "f32.h5", "--hidden-as", "float32")
    assert code == 0, out
    with h5py.File(tmp_path / "f32.h5", "r") as f:
        assert np.isfinite(f["hidden"][...]).all() and np.abs(f["hidden"][...]).max() > 65504
