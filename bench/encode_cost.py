"""Benchmark: what encoding the tapped features costs extraction, per stored dtype.

At Qwen3-8B's width (hidden 4096, bf16 activations) over one batch of `tokens` valid tokens,
times common.store.encode_hidden for one tapped layer, as extract's hook runs it (bf16 cast,
fp8 with per-token scales and nvfp4, each eager and compiled), beside one random-weight Qwen3-8B
decoder layer's forward over the same tokens (one sequence of `tokens`, sdpa): the yardstick
inside the call, so `share_of_forward` = layers_tapped x encode / (num_layers x layer forward)
is the encoder's share of a bare forward, without building the whole 8B target (which the
whole-loop `bench_extract.py --hidden-dtype nvfp4` measures where a call has the minutes).
Also records the compiled nvfp4 encoder's first call (its compile), whether its bytes (and the
compiled fp8 encoder's) equal the eager encoder's on this device (any e4m3 block scale decodes
validly; equal bytes say the compiled choice of the least-error scale is the eager one), and
where its time goes (a profile of three calls: the top kernels on a GPU, operators on the
CPU); then what training's decode of those features costs, eager and compiled (`decode`).
JSON lines to stdout and, where $OUT is set, $OUT/encode_cost.jsonl:

    python bench/encode_cost.py [--device cuda] [--tokens 11776] [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
from jsonl import emit_to  # bench/ is on sys.path: scripts run as bench/x.py
from shapes import QWEN3_8B
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from common.fp4 import compiled_encoder, quantize_nvfp4
from common.store import decode_scaled_hidden, encode_hidden


def _ms(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall ms of `run` after two warm-up calls, synchronized per call."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


emit = emit_to("encode_cost.jsonl")


def layer_forward_ms(tokens: int, device: torch.device, repeats: int) -> float:
    """One Qwen3-8B decoder layer's forward (bf16, random weights, no grad) over one sequence."""
    config = Qwen3Config(**QWEN3_8B, attn_implementation="sdpa")
    layer = Qwen3DecoderLayer(config, layer_idx=0).to(device, torch.bfloat16).eval()
    rotary = Qwen3RotaryEmbedding(config).to(device)
    hidden = torch.randn(1, tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
    positions = torch.arange(tokens, device=device)[None]
    cos_sin = rotary(hidden, positions)

    def run() -> object:
        with torch.no_grad():
            return layer(hidden, position_embeddings=cos_sin, attention_mask=None)

    return _ms(run, device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=11_776, help="valid tokens in the batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers-tapped", type=int, default=5)
    parser.add_argument(
        "--also-one-region",
        action="store_true",
        help="also time the whole nvfp4 encoder as one compiled region (rows dynamic): whether "
        "inductor fuses the six candidates' reads where the three-part encoder cannot",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    # activations of a middle layer's scale: a few outlier channels, as real features have
    features = torch.randn(args.tokens, 4096, device=device, dtype=torch.bfloat16)
    features[:, :8] *= 40

    t0 = time.perf_counter()
    compiled_rows, compiled_scales = encode_hidden(features, "nvfp4", compiled=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_call_s = time.perf_counter() - t0
    eager_rows, eager_scales = encode_hidden(features, "nvfp4")
    fp8_compiled_bits, fp8_compiled_scales = encode_hidden(features, "float8_e4m3fn", True)
    fp8_eager_bits, fp8_eager_scales = encode_hidden(features, "float8_e4m3fn")
    emit(
        {
            "part": "nvfp4_compiled_vs_eager",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "first_call_s": round(first_call_s, 2),
            "rows_equal": bool(torch.equal(compiled_rows, eager_rows)),
            "rows_differing": int((compiled_rows != eager_rows).any(-1).sum()),
            "scales_equal": bool(torch.equal(compiled_scales, eager_scales)),
            "fp8_rows_differing": int((fp8_compiled_bits != fp8_eager_bits).any(-1).sum()),
            "fp8_scales_equal": bool(torch.equal(fp8_compiled_scales, fp8_eager_scales)),
        }
    )

    layer_ms = layer_forward_ms(args.tokens, device, args.repeats)
    forward_ms = layer_ms * QWEN3_8B["num_hidden_layers"]
    emit({"part": "yardstick", "layer_forward_ms": round(layer_ms, 3), "tokens": args.tokens})
    cases: dict[str, Callable[[], object]] = {
        "bfloat16": lambda: encode_hidden(features, "bfloat16"),
        "float8_e4m3fn": lambda: encode_hidden(features, "float8_e4m3fn"),
        "float8_e4m3fn_compiled": lambda: encode_hidden(features, "float8_e4m3fn", True),
        "nvfp4_eager": lambda: encode_hidden(features, "nvfp4"),
        "nvfp4_compiled": lambda: encode_hidden(features, "nvfp4", compiled=True),
    }
    if args.also_one_region:
        one_region = compiled_encoder(quantize_nvfp4)
        t0 = time.perf_counter()
        one_rows, one_scales = one_region(features)
        emit(
            {
                "part": "nvfp4_one_region_vs_eager",
                "first_call_s": round(time.perf_counter() - t0, 2),
                "rows_differing": int((one_rows != eager_rows).any(-1).sum()),
                "scales_equal": bool(torch.equal(one_scales, eager_scales)),
            }
        )
        cases["nvfp4_one_region"] = lambda: one_region(features)
    for name, run in cases.items():
        ms = _ms(run, device, args.repeats)
        emit(
            {
                "part": "encode",
                "hidden_dtype": name,
                "encode_ms_per_layer": round(ms, 3),
                "vs_layer_forward": round(ms / layer_ms, 4),
                "share_of_forward": round(args.layers_tapped * ms / forward_ms, 4),
                "tokens": args.tokens,
            }
        )
    profile_kernels(cases["nvfp4_compiled"], device)
    decode_cost(features, layer_ms, device, args.repeats)


def decode_cost(
    features: torch.Tensor, layer_ms: float, device: torch.device, repeats: int
) -> None:
    """What training's decode of the same features costs (`decode_scaled_hidden` to bf16, as
    the step decodes a batch of an fp8 or nvfp4 store), eager and compiled, per tapped layer:
    the drafter's step pays it for every tapped layer of every batch. Also whether the compiled
    decode's values equal eager's on this device."""
    D = features.shape[-1]
    for dtype in ("float8_e4m3fn", "nvfp4"):
        stored, scale = encode_hidden(features, dtype)
        want = decode_scaled_hidden(stored, scale, D, torch.bfloat16)
        got = decode_scaled_hidden(stored, scale, D, torch.bfloat16, compiled=True)
        for compiled in (False, True):
            decode = functools.partial(
                decode_scaled_hidden, stored, scale, D, torch.bfloat16, compiled
            )
            ms = _ms(decode, device, repeats)
            emit(
                {
                    "part": "decode",
                    "hidden_dtype": dtype,
                    "compiled": compiled,
                    "decode_ms_per_layer": round(ms, 3),
                    "vs_layer_forward": round(ms / layer_ms, 4),
                    "values_equal": bool(torch.equal(got, want)),
                    "tokens": features.shape[0],
                }
            )


def profile_kernels(run: Callable[[], object], device: torch.device, top: int = 12) -> None:
    """The `top` kernels (GPU) or operators (CPU) of three calls of `run` by time, each one's
    calls and its mean time per call of `run`: where the compiled nvfp4 encoder's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(3):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    gpu = device.type == "cuda"

    def wanted(event: object) -> bool:
        # on a GPU the kernels (device time); on the CPU the aten operators themselves
        key = event.key
        if gpu:
            return event.device_time_total > 0 and not key.startswith("aten::")
        return key.startswith("aten::")

    rows = [e for e in prof.key_averages() if wanted(e)]
    rows.sort(key=lambda e: e.device_time_total if gpu else e.self_cpu_time_total, reverse=True)
    for e in rows[:top]:
        us = (e.device_time_total if gpu else e.self_cpu_time_total) / 3
        emit(
            {
                "part": "profile_nvfp4_compiled",
                "kernel": e.key[:120],
                "calls_per_encode": e.count / 3,
                "ms_per_encode": round(us / 1e3, 4),
            }
        )


if __name__ == "__main__":
    main()
