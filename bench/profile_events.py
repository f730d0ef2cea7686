"""How `bench/profile_train_step.py` sorts one training step's profile into categories (issue 12).

`instrument()` wraps record_function scopes around BlockAttention's construction (mask build),
block_attention (attention) and chunked_block_loss (LM head + loss) in the project's modules;
`classify()` puts each kernel (or, in the CPU smoke, each op) in one category from those scopes,
its enclosing ops' and autograd nodes' names and its own name (attention fwd/bwd, mask build,
LM head + loss, matmuls fwd/bwd, optimizer + clipping, copies, other fwd/bwd); `breakdown()`
turns a torch.profiler run into ms per step by category and the top kernels.

Imported by bench/profile_train_step.py (bench/ is on sys.path), which runs as
`python bench/profile_train_step.py --shape tiny --device cpu` (see there).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.autograd.profiler import record_function

import stage2_train.attention as attention_module
import stage2_train.step as step_module
import stage2_train.trainstep as trainstep_module

CATEGORIES = (
    "attention_fwd",
    "attention_bwd",
    "mask_build",
    "lm_head_loss",
    "matmul_fwd",
    "matmul_bwd",
    "optimizer",
    "copies",
    "other_fwd",
    "other_bwd",
)
MATMUL_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "splitk", "gemv")  # cuBLAS
MATMUL_OPS = ("mm", "addmm", "bmm", "matmul", "linear")  # the CPU smoke's op names
COPY_NAMES = ("memcpy", "memset", "copy", "catarraybatched")


def instrument() -> list[str]:
    """record_function scopes around the mask build, the attention and the loss (for the
    profile's categories); returns what could not be wrapped (those then count by name)."""
    missing = []
    if hasattr(step_module, "BlockAttention"):

        class ScopedBlockAttention(step_module.BlockAttention):  # type: ignore[name-defined,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                with record_function("dflash::mask_build"):
                    super().__init__(*args, **kwargs)

        step_module.BlockAttention = ScopedBlockAttention  # type: ignore[misc]
    else:
        missing.append("stage2_train.step.BlockAttention (mask build)")
    if hasattr(attention_module, "block_attention"):
        attend = attention_module.block_attention

        @torch.compiler.disable  # like the original: compiled layers call it from eager code
        def scoped_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
            with record_function("dflash::attention"):
                return attend(*args, **kwargs)

        attention_module.block_attention = scoped_attention
    else:
        missing.append("stage2_train.attention.block_attention (attention forward)")
    if hasattr(trainstep_module, "chunked_block_loss"):
        loss_fn = trainstep_module.chunked_block_loss

        def scoped_loss(*args: Any, **kwargs: Any) -> Any:
            with record_function("dflash::loss"):
                return loss_fn(*args, **kwargs)

        trainstep_module.chunked_block_loss = scoped_loss
    else:
        missing.append("stage2_train.trainstep.chunked_block_loss (LM head + loss)")
    return missing


def classify(name: str, scopes: list[str], compiled_layers: bool) -> str:
    """Category of one kernel (or CPU op) from its name and its enclosing ops' names."""
    lowered, joined = name.lower(), " | ".join(scopes)
    backward = "Backward" in joined or "autograd::engine" in joined
    if "dflash::mask_build" in joined:
        return "mask_build"
    if "dflash::loss" in joined or "ChunkedHeadLoss" in joined:
        return "lm_head_loss"
    attention = (
        "attention" in lowered  # flex's kernels and ops; SDPA's (the CPU backend)
        or lowered.startswith("triton_tem")
        or "dflash::attention" in joined
        or (not compiled_layers and "CompiledFunction" in joined)  # the only compiled region
    )
    if attention:
        return "attention_bwd" if backward else "attention_fwd"
    if "Optimizer." in joined or "multi_tensor" in lowered or "foreach" in lowered:
        return "optimizer"
    if any(n in lowered for n in COPY_NAMES):
        return "copies"
    if any(n in lowered for n in MATMUL_NAMES) or lowered.split("::")[-1] in MATMUL_OPS:
        return "matmul_bwd" if backward else "matmul_fwd"
    return "other_bwd" if backward else "other_fwd"


def _scopes(event: Any) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def breakdown(prof: Any, steps: int, compiled_layers: bool, on_cuda: bool) -> dict[str, Any]:
    """ms per step by category and the top kernels: GPU kernel time on CUDA, else every CPU
    op's self time (a smoke of the same bookkeeping)."""
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list] = {}
    for event in prof.events():
        if on_cuda:
            items = [(k.name, k.duration) for k in event.kernels]
        elif event.device_type == torch.autograd.DeviceType.CPU and not event.is_async:
            items = [(event.name, event.self_cpu_time_total)]
        else:
            items = []
        if not items:
            continue
        scopes = _scopes(event)
        for name, us in items:
            category = classify(name, scopes, compiled_layers)
            per_cat[category] += us
            entry = per_kernel.setdefault(name, [0.0, 0, category])
            entry[0] += us
            entry[1] += 1
    total = sum(per_cat.values()) or 1.0
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:30]
    return {
        "kernel_ms_per_step": round(total / steps / 1e3, 3),
        "categories": {
            c: {
                "ms_per_step": round(per_cat[c] / steps / 1e3, 3),
                "share": round(per_cat[c] / total, 4),
            }
            for c in CATEGORIES
            if c in per_cat
        },
        "top_kernels": [
            {
                "name": name[:160],
                "category": cat,
                "ms_per_step": round(us / steps / 1e3, 3),
                "calls_per_step": round(n / steps, 1),
            }
            for name, (us, n, cat) in top
        ],
    }
