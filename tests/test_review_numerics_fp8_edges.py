"""What extraction's finiteness check relies on, at the edges of the fp8 quantizer and end to
end: a row holding NaN or Inf gets a non-finite scale (fill_shard checks the scales, not the
fp8 bits, which have no Inf), finite rows at the ends of the float range get a positive finite
scale and decode within FORMAT.md's bound, and a target whose outputs are NaN writes no shard."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_extract import make_config, write_data
from transformers import AutoModelForCausalLM

from common.store import StoreError, committed_shards, dequantize_fp8, quantize_fp8
from stage1_extract.run import run_extract


def test_non_finite_rows_get_a_non_finite_scale_and_finite_rows_a_positive_one() -> None:
    big = torch.finfo(torch.bfloat16).max  # the largest value a bf16 target can hand over
    rows = torch.tensor(
        [
            [float("nan"), 1.0, 2.0, 3.0],
            [float("inf"), 1.0, 2.0, 3.0],
            [1.0, float("-inf"), 0.0, 0.0],
            [big, -big / 3, 1.0, 0.0],  # x / scale may land above 448: clamped, not NaN
            [1e-40, -5e-41, 0.0, 1e-45],  # subnormal amax: a subnormal but positive scale
            [0.0, 0.0, 0.0, 0.0],  # padding: scale 1, zeros
        ]
    )
    bits, scale = quantize_fp8(rows)
    assert not torch.isfinite(scale[:3]).any()
    finite = rows[3:]
    assert torch.isfinite(scale[3:]).all() and (scale[3:] > 0).all() and scale[5] == 1.0
    decoded = dequantize_fp8(bits[3:], scale[3:])
    assert torch.isfinite(decoded).all()
    amax = finite.abs().amax(-1, keepdim=True)
    # FORMAT.md's bound, plus the fp32 rounding of the division and product (and of a
    # subnormal scale's few bits, which only the 1e-40 row has)
    bound = finite.abs() * (2**-4 + 2**-20) + amax * 2**-18 + 2**-149
    assert ((decoded - finite).abs() <= bound).all()
    assert (bits[3:].view(torch.float8_e4m3fn).float().abs().amax(-1)[:2] == 448.0).all()


def test_a_target_that_outputs_nan_writes_no_shard(tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_qwen3, tmp_path / "nan-target"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # one NaN weight of the last MLP: NaN logits at every token
        model.model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(model_dir)
    out = tmp_path / "store"
    cfg = make_config(model_dir, write_data(tmp_path, 1), out, "store.hidden_dtype=float8_e4m3fn")
    with pytest.raises(StoreError, match="NaN/Inf hidden states or logits"):
        run_extract(cfg)
    assert committed_shards(out) == []
