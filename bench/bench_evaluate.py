"""Benchmark: `dflash evaluate`'s cached decoding against the recompute reference.

Builds a random-weight target (Qwen3-8B's shape by default, `--tiny` for a 4-layer CPU one)
and a random-weight DFlash drafter (5 layers, block 16) directly on the device, random token
prompts, then decodes greedily with prompt lookup and with the drafter, twice each: the cached
path `dflash evaluate` runs (target KV cache, feature buffer, drafter context cache) and the
uncached reference (evaluation.reference: every forward over the whole sequence). Reports per
method and path: seconds, new tokens/s, target forwards, tau, and whether both paths
generated the same tokens (on the CPU in float32 they must; in bf16 on a GPU rounding may
differ). Random weights say nothing about acceptance: the figures are about speed.
`--temperature T` decodes sampled as `dflash evaluate --temperature` does (keyed draws, per
prompt), so the draws' cost per verification shows beside greedy's.
JSON lines to stdout and $OUT/bench_evaluate.jsonl.

    python bench/bench_evaluate.py --device cuda:0                 # Qwen3-8B shape, bf16
    python bench/bench_evaluate.py --device cuda:0 --temperature 0.6 --top-p 0.95
    python bench/bench_evaluate.py --tiny --device cpu --dtype float32   # seconds, CPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from jsonl import emit_to  # bench/ is on sys.path: scripts run as bench/x.py
from shapes import QWEN3_8B
from transformers import AutoModelForCausalLM, Qwen3Config

from common.tiny import tiny_config
from evaluation.acceptance import (
    CachedTarget,
    DraftFn,
    Sampling,
    TokenPicker,
    prompt_lookup_draft,
    speculative_generate,
)
from evaluation.dflash_draft import dflash_draft_fn
from evaluation.reference import TappedTarget, reference_dflash_draft_fn, reference_generate
from stage1_extract.config import TargetConfig
from stage1_extract.target import resolve_tapped_layers
from stage2_train.config import DrafterConfig
from stage2_train.model import DFlashDrafter, drafter_shape

emit = emit_to("bench_evaluate.jsonl")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_all(
    path: str,
    target: torch.nn.Module,
    tapped: list[int] | None,
    make_draft: Callable[[], DraftFn],
    prompts: list[list[int]],
    num_new: int,
    sampling: Sampling,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Decode every prompt on one path; its figures and the generated tokens."""
    device = next(target.parameters()).device
    picker = TokenPicker(sampling)
    runner_type = CachedTarget if path == "cached" else TappedTarget
    runner = runner_type(target, tapped, picker)
    generate = speculative_generate if path == "cached" else reference_generate
    synchronize(device)
    start = time.perf_counter()
    outputs = []
    for index, prompt in enumerate(prompts):
        picker.start(index)  # as measure_acceptance keys each prompt's draws
        outputs.append(generate(runner, prompt, make_draft(), num_new))
    synchronize(device)
    seconds = time.perf_counter() - start
    forwards = sum(len(gains) for _, gains, _ in outputs)
    new = sum(len(generated) for generated, _, _ in outputs)
    taus = [sum(gains) / len(gains) for _, gains, _ in outputs]
    figures = {
        "seconds": round(seconds, 3),
        "generated_tokens": new,
        "tokens_per_s": round(new / seconds, 2),
        "forwards": forwards,
        "ms_per_forward": round(1000 * seconds / forwards, 2),
        "tau": round(sum(taus) / len(taus), 4),
    }
    return figures, [generated for generated, _, _ in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="4-layer target (CPU test run)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--drafter-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-reference", action="store_true", help="time the cached path only")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: every token")
    args = parser.parse_args()
    sampling = Sampling(args.temperature, args.top_p, top_k=args.top_k)
    if problems := sampling.problems():
        parser.error("; ".join(problems))

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = tiny_config("qwen3", 512) if args.tiny else Qwen3Config(**QWEN3_8B)
    torch.manual_seed(0)
    with device:  # random init on the device: an 8B init on the CPU takes minutes
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    target_dict = config.to_dict()
    num_tapped = 2 if args.tiny else 5
    tapped = resolve_tapped_layers(TargetConfig(num_tapped=num_tapped), config.num_hidden_layers)
    shape = drafter_shape(
        DrafterConfig(num_layers=args.drafter_layers, block_size=args.block_size),
        target_dict,
        num_tapped,
        config.vocab_size,
        mask_token_id=config.vocab_size - 1,
    )
    with device:
        drafter = DFlashDrafter(shape).to(dtype).eval()
    embed_VD = target.get_input_embeddings().weight.detach()
    head_VD = target.get_output_embeddings().weight.detach()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        0, config.vocab_size - 1, (args.num_prompts, args.prompt_tokens), generator=generator
    ).tolist()
    num_draft = args.block_size - 1

    def lookup(tokens: list[int], _feats: torch.Tensor | None) -> list[int]:
        return prompt_lookup_draft(tokens, num_draft)

    methods: dict[str, tuple[list[int] | None, dict[str, Any]]] = {
        "prompt_lookup": (None, {"cached": lambda: lookup, "reference": lambda: lookup}),
        "dflash": (
            tapped,
            {
                "cached": lambda: dflash_draft_fn(drafter, embed_VD, head_VD),
                "reference": lambda: reference_dflash_draft_fn(drafter, embed_VD, head_VD),
            },
        ),
    }
    setting = {
        "target": "tiny" if args.tiny else "qwen3-8b-shape",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "drafter_layers": args.drafter_layers,
        "block_size": args.block_size,
        "tapped_layers": tapped,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    paths = ["cached"] if args.no_reference else ["cached", "reference"]
    for method, (layers, makers) in methods.items():
        # warm-up: allocator, kernels, lazy inits; not timed
        decode_all("cached", target, layers, makers["cached"], prompts[:1], 4, sampling)
        figures: dict[str, dict[str, Any]] = {}
        generated: dict[str, list[list[int]]] = {}
        for path in paths:
            figures[path], generated[path] = decode_all(
                path, target, layers, makers[path], prompts, args.new_tokens, sampling
            )
            emit({"what": "evaluate", "method": method, "path": path, **setting, **figures[path]})
        if "reference" in figures:
            same = generated["cached"] == generated["reference"]
            speedup = figures["reference"]["seconds"] / figures["cached"]["seconds"]
            emit(
                {
                    "what": "evaluate_speedup",
                    "method": method,
                    **setting,
                    "speedup": round(speedup, 2),
                    "identical_tokens": same,
                }
            )
    if device.type == "cuda":
        emit({"what": "memory", "peak_GB": round(torch.cuda.max_memory_allocated(device) / 1e9, 2)})


if __name__ == "__main__":
    main()
