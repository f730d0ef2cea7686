"""Optimizer and learning-rate schedule of `dflash train`: AdamW, linear warmup, cosine decay.

Numerics: parameters live in `run.dtype` (bfloat16 by default, like the yardstick), and AdamW's
moment buffers take the parameters' dtype. The fused CUDA kernel does each element's update
in fp32 registers and rounds once when storing, so the only bf16 loss is that rounding: updates
smaller than half a bf16 ulp of a weight (~0.4% of its magnitude) vanish. At the paper's
lr 6e-4 that only bites in the last few percent of the cosine tail. `run.dtype=mixed` keeps
fp32 master weights and fp32 AdamW states with bf16 matmuls under autocast (+8 bytes per
parameter: ~8 GB more for a Qwen3-8B-size drafter); `run.dtype=float32` keeps everything in
fp32 (the CPU tests use it, for exact resume comparisons).
"""

from __future__ import annotations

import math

import torch

from stage2_train.config import OptimConfig


def build_optimizer(
    params: list[torch.nn.Parameter], cfg: OptimConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over `params`; the fused kernel on CUDA, foreach elsewhere."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based) of `total_steps`."""
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    )
