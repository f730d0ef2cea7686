"""FP8 matmuls in the drafter's linear layers (`run.fp8_linear`), through torchao's float8 training.

    dflash train ... --set run.fp8_linear=rowwise      # or tensorwise; pip install '.[fp8]'

`convert_to_fp8` swaps each nn.Linear of the drafter whose dims are multiples of 16 (what
torch._scaled_mm requires) for torchao's Float8Linear: the same `weight` Parameter under the
same name, whose forward and backward cast the matmul operands to fp8 with dynamic scales
(`tensorwise`: one scale per tensor, e4m3 forward and e5m2 gradients; `rowwise`: one per row,
e4m3 throughout, power-of-2 scales) and run torch._scaled_mm. Master weights, AdamW states,
checkpoints and the export are those of a run without fp8. The frozen embedding and LM head
are not modules of the drafter: they stay in the compute dtype.

fp8 needs CUDA with compute capability >= 8.9 (Ada, Hopper and later). On the CPU torchao
emulates it (`Float8LinearConfig.emulate`): the operands are rounded to fp8 with the same scales,
then multiplied in fp32; no speed-up, for tests. (torch's own CPU _scaled_mm gives the same
tensorwise results, but torch 2.11's refuses rowwise scales.) The served drafter runs bf16, so
`plain_twin` gives the evaluations a model without fp8 that shares the trained parameters.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from common.logging import get_logger
from stage2_train.model import DFlashDrafter

INSTALL = "pip install 'dflash-offline[fp8]' (torchao)"
MIN_CAPABILITY = (8, 9)


def check_fp8_installed(recipe: str | None) -> None:
    """ValueError naming the install when `run.fp8_linear` is set and torchao is missing."""
    if recipe is not None and importlib.util.find_spec("torchao") is None:
        raise ValueError(
            f"run.fp8_linear={recipe} needs torchao, which is not installed: {INSTALL}, "
            "or set run.fp8_linear=null"
        )


def check_fp8_device(recipe: str, device: torch.device) -> None:
    """ValueError naming the fix when `device` cannot run fp8 matmuls."""
    if device.type != "cuda":
        return  # the CPU: emulated (see the module docstring)
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"run.fp8_linear={recipe} needs a GPU of compute capability >= 8.9 (Ada, Hopper or "
            f"later); {device} ({torch.cuda.get_device_name(device)}) has "
            f"{capability[0]}.{capability[1]}: set run.fp8_linear=null or train on such a GPU"
        )


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """torch._scaled_mm multiplies only matrices whose dims are multiples of 16."""
    if not isinstance(module, nn.Linear):
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def convert_to_fp8(
    model: DFlashDrafter, recipe: str, device: torch.device, num_tokens: tuple[int, int]
) -> list[str]:
    """Swap `model`'s eligible linear layers for Float8Linear in place (before DDP and
    compile); returns the names of the layers swapped. `num_tokens`: the context and block
    tokens of a micro-batch (T = sequences * seq_len, Q = sequences * anchors * B)."""
    check_fp8_device(recipe, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type == "cpu":
        config = dataclasses.replace(config, emulate=True)
    # The weight gradient contracts over the tokens (T, Q or T + Q rows reach a layer), and
    # the GPU's torch._scaled_mm refuses an inner dim that is not a multiple of 16: such
    # counts are zero-padded per matmul (a copy, so only when one needs it)
    if any(n % 16 for n in num_tokens):
        config = dataclasses.replace(config, pad_inner_dim=True)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    convert_to_float8_training(model, module_filter_fn=fp8_eligible, config=config)
    swapped = [name for name in linears if type(model.get_submodule(name)) is not nn.Linear]
    kept = sorted(set(linears) - set(swapped))
    get_logger().info(
        "fp8 %s matmuls%s%s in %d of %d linear layers%s",
        recipe,
        " (emulated on the CPU)" if config.emulate else "",
        f" (tokens {num_tokens} padded to multiples of 16)" if config.pad_inner_dim else "",
        len(swapped),
        len(linears),
        f" (dims not multiples of 16, kept: {', '.join(kept)})" if kept else "",
    )
    return swapped


def plain_twin(model: DFlashDrafter) -> DFlashDrafter:
    """A DFlashDrafter of plain nn.Linear layers holding `model`'s own Parameters (no copy:
    every optimizer step shows in it), to evaluate the drafter as the export serves it."""
    with torch.device("meta"):
        twin = DFlashDrafter(model.shape)
    twin.load_state_dict(model.state_dict(keep_vars=True), assign=True)
    return twin
