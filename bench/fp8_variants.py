"""Bytes and error of fp8 variants of the stored hidden states, on real features (issue 12's
size question): the bf16 features of a bf16 store requantized each way, compressed as the store
compresses a row (zstd level 1 over one sequence's bits and scales), against the bf16 bytes as
the store compresses them (byte shuffle, then zstd level 1). Error: relative RMS over the whole
sample (||x - x'|| / ||x||) and the worst token's cosine distance, both against bf16.

    python bench/fp8_variants.py --store BF16_STORE [--sequences 16]

Variants: e4m3 and e5m2 with one fp32 scale per token and tapped layer (the store's fp8 is
e4m3 per token), and e4m3 with one scale per channel and tapped layer over each sequence
(outlier channels then no longer set every token's scale); and two 4-bit ones (e2m1, two
values a byte), asked by issue 12's size goal at five layers: MXFP4 (OCP microscaling: a
power-of-two scale per 32 features, one byte) and NVFP4-style (an e4m3 scale per 16 features
under one fp32 scale per token and layer). One JSON line per variant.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from numcodecs import Blosc, Zstd

from common.fp4 import encode_fp4
from common.store import bf16_to_bits, open_store
from stage2_train.data import StoreSequences

ZSTD = Zstd(level=1)
# the store's codec for bf16 features (store.byte_shuffle, FORMAT.md): zstd after a byte shuffle
SHUFFLED = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=1 << 20)


def quantize(
    x_SKD: torch.Tensor, dtype: torch.dtype, per: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, fp32 scales): per token ([S, K] scales) or per channel ([K, D])."""
    limit = torch.finfo(dtype).max
    amax = x_SKD.abs().amax(-1) if per == "token" else x_SKD.abs().amax(0)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / limit)
    expanded = scale[..., None] if per == "token" else scale[None]
    return (x_SKD / expanded).clamp(-limit, limit).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, per: str) -> torch.Tensor:
    return q.float() * (scale[..., None] if per == "token" else scale[None])


def fp4_bytes_and_decoded(x_SKD: torch.Tensor, kind: str) -> tuple[int, torch.Tensor]:
    """(zstd bytes of the codes, two a byte, and the scale arrays a store would keep; the
    decoded features) for data.hidden_as_fp4's layouts (common/fp4.py)."""
    encoded = encode_fp4(x_SKD, kind)  # type: ignore[arg-type]
    flat = encoded.codes.reshape(-1)
    packed = (flat[0::2] | (flat[1::2] << 4)).numpy()
    scales = [t.contiguous().numpy() for t in encoded.stored_scales]
    return packed_bytes(packed, *scales), encoded.decoded()


def packed_bytes(*arrays: np.ndarray) -> int:
    return sum(len(ZSTD.encode(np.ascontiguousarray(a))) for a in arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="a store with bfloat16 hidden states")
    parser.add_argument("--sequences", type=int, default=16)
    args = parser.parse_args()
    info = open_store(args.store, require_complete=True)
    if info.hidden_dtype != "bfloat16":
        raise SystemExit(
            f"{args.store}: hidden_dtype {info.hidden_dtype}; extract with "
            "--set store.hidden_dtype=bfloat16 for this comparison"
        )
    rows = StoreSequences(
        info,
        num_anchors=1,
        per_document=False,
        block_size=1,
        label_target="data",
        distill=False,
        seed=0,
    )
    count = min(int(info.attrs["counts"]["sequences"]), args.sequences)
    features = []  # (bf16 hidden states of the real tokens [T, K, D]) per sequence
    for index in range(count):
        row = rows.read_row(index)
        features.append(row["hidden"][row["document_ids"] >= 0])  # padding left out
    variants: list[tuple[str, torch.dtype | None, str]] = [
        ("e4m3, per token (the store's fp8)", torch.float8_e4m3fn, "token"),
        ("e5m2, per token", torch.float8_e5m2, "token"),
        ("e4m3, per channel and sequence", torch.float8_e4m3fn, "channel"),
        ("mxfp4 (e2m1, power-of-two scale per 32)", None, "mxfp4"),
        ("nvfp4-style (e2m1, e4m3 scale per 16, fp32 per token)", None, "nvfp4"),
    ]
    tokens = sum(x.shape[0] for x in features)
    bf16 = sum(len(SHUFFLED.encode(bf16_to_bits(x))) for x in features)
    print(json.dumps({"variant": "bf16", "bytes_per_token": round(bf16 / tokens, 1)}))
    for name, dtype, per in variants:
        size, err_sq, ref_sq, worst_cos = 0, 0.0, 0.0, 0.0
        for hidden in features:
            x = hidden.float()
            if dtype is None:
                nbytes, back = fp4_bytes_and_decoded(x, per)
                size += nbytes
            else:
                q, scale = quantize(x, dtype, per)
                size += packed_bytes(q.view(torch.uint8).numpy(), scale.numpy())
                back = dequantize(q, scale, per)
            err_sq += float(((back - x) ** 2).sum())
            ref_sq += float((x**2).sum())
            cos = torch.nn.functional.cosine_similarity(back, x, dim=-1)
            worst_cos = max(worst_cos, float((1 - cos).max()))
        record = {
            "variant": name,
            "bytes_per_token": round(size / tokens, 1),
            "vs_bf16": round(size / bf16, 3),
            "rel_rms_error": round((err_sq / ref_sq) ** 0.5, 5),
            "worst_token_cos_distance": round(worst_cos, 6),
            "tokens": tokens,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
