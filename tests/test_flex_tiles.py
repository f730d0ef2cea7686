"""The flex kernel tiles offered to inductor for 64-token mask tiles (stage2_train/flex_tiles.py).

The GPU kernels themselves run on the device only (bench/flex_sweep.py checks their output and
gradients against an fp32 reference there); here: which candidates inductor is offered, that
every one divides a 64-token tile, and that installing and suspending the hooks is reversible.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.choices import InductorChoices
from torch._inductor.template_heuristics.triton import FlexBwDConfig, FlexConfig

from stage2_train import flex_tiles
from stage2_train.flex_tiles import BWD_TILES, FWD_TILES, fitted_configs

MEASURED_FWD = FlexConfig(*FWD_TILES)
MEASURED_BWD = FlexBwDConfig(*BWD_TILES)


def _divides_64(config: object) -> bool:
    tiles = [v for k, v in vars(config).items() if k.startswith("block_")]
    return all(64 % t == 0 for t in tiles)


def test_measured_tiles_divide_64_and_satisfy_the_backward_kernel() -> None:
    assert _divides_64(MEASURED_FWD) and _divides_64(MEASURED_BWD)
    m1, n1, m2, n2 = BWD_TILES[:4]
    assert n1 % m1 == 0 and m2 % n2 == 0  # what flex's backward template requires


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_precision_gets_the_measured_tiles_alone(dtype: torch.dtype, head_dim: int) -> None:
    # the H100/H200 defaults, neither of which divides 64 (so nothing would lower)
    fwd_default, bwd_default = FlexConfig(128, 64, 3, 8), FlexBwDConfig(64, 128, 128, 64, 3, 8)
    assert fitted_configs([fwd_default], MEASURED_FWD, head_dim, dtype, "cuda") == [MEASURED_FWD]
    assert fitted_configs([bwd_default], MEASURED_BWD, head_dim, dtype, "cuda") == [MEASURED_BWD]


def test_other_cases_keep_inductor_tiles_capped_at_64() -> None:
    # fp32 at head dim 64 (the evaluations' forward): 128 x 32 would not divide 64
    fp32 = [FlexConfig(128, 32, 3, 4), FlexConfig(64, 32, 3, 4)]
    assert fitted_configs(fp32, MEASURED_FWD, 64, torch.float32, "cuda") == [
        FlexConfig(64, 32, 3, 4)  # capped, and the duplicate it made dropped
    ]
    wide = [FlexBwDConfig(64, 64, 64, 64, 2, 4)]  # bf16 at head dim 256: unmeasured, kept
    assert fitted_configs(wide, MEASURED_BWD, 256, torch.bfloat16, "cuda") == wide
    tiny = [FlexBwDConfig(16, 16, 16, 16, 1, 4)]
    assert fitted_configs(tiny, MEASURED_BWD, 128, torch.float32, "cuda") == tiny
    assert all(_divides_64(c) for c in fitted_configs(fp32, MEASURED_FWD, 64, torch.float32, None))


def test_cpu_kernels_keep_inductor_choices() -> None:
    configs = [FlexConfig(128, 128, 3, 4)]
    assert fitted_configs(configs, MEASURED_FWD, 64, torch.bfloat16, "cpu") is configs


def test_install_is_idempotent_and_suspendable() -> None:
    names = ("get_flex_attention_fwd_configs", "get_flex_attention_bwd_configs")
    before = {n: getattr(InductorChoices, n) for n in names}
    try:
        flex_tiles.install()
        installed = {n: getattr(InductorChoices, n) for n in names}
        flex_tiles.install()
        assert {n: getattr(InductorChoices, n) for n in names} == installed
        originals = flex_tiles._originals
        assert all(installed[n] is not originals[n] for n in names)
        # on the CPU the hooks pass inductor's own candidates through
        cpu = InductorChoices().get_flex_attention_fwd_configs(64, torch.bfloat16, "cpu")
        assert cpu == originals[names[0]](InductorChoices(), 64, torch.bfloat16, "cpu")
        with flex_tiles.inductor_defaults():
            assert all(getattr(InductorChoices, n) is originals[n] for n in names)
        assert {n: getattr(InductorChoices, n) for n in names} == installed
    finally:
        for name, method in before.items():
            setattr(InductorChoices, name, method)
        flex_tiles._originals.clear()


def test_forward_options_only_where_measured() -> None:
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    assert flex_tiles.forward_options(q, (64, 64)) is None  # the CPU: inductor's own choices
    measured = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4}
    measured |= {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}
    measured |= {"bwd_num_stages": 3, "bwd_num_warps": 4}
    assert flex_tiles.options_for("cuda", torch.bfloat16, 64, (64, 64)) == measured
    assert flex_tiles.options_for("cuda", torch.float16, 128, (64, 64)) == measured
    assert flex_tiles.options_for("cuda", torch.float32, 64, (64, 64)) is None  # evaluations
    assert flex_tiles.options_for("cuda", torch.bfloat16, 256, (64, 64)) is None
    assert flex_tiles.options_for("cuda", torch.bfloat16, 64, (128, 128)) is None  # env 128
    assert flex_tiles.options_for("cpu", torch.bfloat16, 64, (64, 64)) is None
