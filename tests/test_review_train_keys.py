"""`dflash train`'s config keys refuse a bad value before any work, naming the key, the value
and the fix (an audit of every key; the ones that slipped through, each with its test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_factory import FactorySpec, build_store

from common.config import build_config, describe
from stage2_train.config import TrainConfig
from stage2_train.inputs import check_inputs

REQUIRED = ["data.store=s", "run.out=o"]


def problems_of(*sets: str) -> str:
    """The config error of `sets` (each KEY=VALUE), which must be refused."""
    with pytest.raises(ValueError) as err:
        build_config(TrainConfig, None, "train", [*REQUIRED, *sets])
    return str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_size", 0),  # was read as unset: the target's, without a word
        ("intermediate_size", 0),
        ("num_attention_heads", 0),
        ("num_key_value_heads", 0),
        ("head_dim", 0),
        ("intermediate_size", -8),  # was a RuntimeError from the model's build (exit 1)
        ("num_attention_heads", -4),
        ("num_key_value_heads", -2),
        ("head_dim", -16),
    ],
)
def test_drafter_sizes_below_one_are_refused(key: str, value: int) -> None:
    message = problems_of(f"drafter.{key}={value}")
    assert f"drafter: {key} must be >= 1 (or null: the target's), got {value}" in message


@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps"])
@pytest.mark.parametrize("value", [0, -1])
def test_drafter_rope_theta_and_eps_must_be_positive(key: str, value: float) -> None:
    # 0 was read as unset; a negative value trained NaN from step 1, blamed on the store or lr
    message = problems_of(f"drafter.{key}={value}")
    assert f"drafter: {key} must be > 0 (or null: the target's), got {float(value)}" in message


def test_drafter_odd_head_dim_is_refused() -> None:
    # was a shape mismatch deep in RoPE at the first step (exit 1, "a bug")
    message = problems_of("drafter.head_dim=7")
    assert "drafter: head_dim must be even (RoPE rotates pairs of features), got 7" in message


def test_drafter_sizes_that_fit_still_load() -> None:
    sets = ["drafter.num_attention_heads=6", "drafter.head_dim=16", "drafter.rope_theta=1e6"]
    cfg = build_config(TrainConfig, None, "train", [*REQUIRED, *sets])
    assert (cfg.drafter.num_attention_heads, cfg.drafter.rope_theta) == (6, 1e6)


@pytest.mark.parametrize("value", [0, -1])
def test_distill_temperature_must_be_positive(value: float) -> None:
    # 0 trained NaN from step 1 (blamed on the store or the lr); < 0 trained silently toward
    # the target's top-k in reverse order
    message = problems_of("loss.distill_weight=1", f"loss.distill_temperature={value}")
    expected = "distill_temperature must be > 0 (1: the target's own distribution), got"
    assert f"loss: {expected} {float(value)}" in message


@pytest.mark.parametrize("value", [-0.5, 2])
def test_min_lr_ratio_outside_zero_one_is_refused(value: float) -> None:
    # -0.5 took the lr below 0 in the decay (a 4-step run logged lr -8.41e-04: gradient
    # ascent, without a word); 2 raised it above the peak instead of decaying
    message = problems_of(f"optim.min_lr_ratio={value}")
    expected = "min_lr_ratio must be in [0, 1] (the floor as a share of the peak lr), got"
    assert f"optim: {expected} {float(value)}" in message


def test_negative_grad_clip_is_refused() -> None:
    # was read as 0 (off): no clipping, without a word
    message = problems_of("optim.grad_clip=-1")
    assert "optim: grad_clip must be >= 0 (0: off), got -1.0" in message


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["optim.weight_decay=-1"], "optim: weight_decay must be >= 0 (0: off), got -1.0"),
        (
            ["optim.betas=[1.5, 0.9]"],
            "optim: betas must each be in [0, 1) (e.g. [0.9, 0.95]), got ",
        ),
        (
            ["optim.betas=[0.9, -0.1]"],
            "optim: betas must each be in [0, 1) (e.g. [0.9, 0.95]), got ",
        ),
    ],
)
def test_adamw_settings_are_checked_with_the_config(sets: list[str], expected: str) -> None:
    # were AdamW's own ValueErrors ("Invalid beta parameter at index 0: 1.5"), raised once the
    # model was built, naming neither the key nor the fix
    assert expected in problems_of(*sets)


@pytest.mark.parametrize(
    ("key", "value", "partner", "expected"),
    [
        (
            "holdout_sequences",
            -1,
            "num_workers",
            "holdout_sequences must be >= 0 (0: none), got -1",
        ),
        ("num_workers", -1, "holdout_sequences", "num_workers must be >= 0 (0: load in the"),
        ("follow_poll_s", 0, "follow_timeout_s", "follow_poll_s must be > 0, got 0.0"),
        ("follow_timeout_s", -5, "follow_poll_s", "follow_timeout_s must be > 0, got -5.0"),
        ("batch_sequences", 0, "grad_accum", "batch_sequences must be >= 1, got 0"),
        ("grad_accum", -1, "batch_sequences", "grad_accum must be >= 1, got -1"),
    ],
)
def test_paired_checks_name_the_key_and_value(
    key: str, value: int, partner: str, expected: str
) -> None:
    # each pair shared one message naming both keys and neither value
    # ("holdout_sequences and num_workers must be >= 0")
    section = "optim" if key in ("batch_sequences", "grad_accum") else "data"
    message = problems_of(f"{section}.{key}={value}")
    assert f"{section}: {expected}" in message
    assert partner not in message


def test_too_many_anchors_names_the_values_and_the_fix(tmp_path: Path) -> None:
    # was "anchors.num_anchors * block_size is over 64x the sequence length": no value, no fix
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=4))
    sets = ["drafter.block_size=8", "anchors.num_anchors=600", "data.holdout_sequences=1"]
    cfg = build_config(
        TrainConfig, None, "train", [f"data.store={store}", f"run.out={tmp_path / 'run'}", *sets]
    )
    with pytest.raises(ValueError) as err:
        check_inputs(cfg)
    assert (
        "anchors.num_anchors=600 x drafter.block_size=8 = 4800 query tokens a sequence is over "
        "64x the store's 64-token sequences: lower anchors.num_anchors (at most 64 anchors fit "
        "a sequence)"
    ) in str(err.value)


def test_compile_attention_help_says_what_false_does() -> None:
    # said "(GPU: required)", yet false runs on a GPU: train.py picks the dense SDPA path
    # (`backend = "flex" if cuda and compile_attention else "sdpa"`), and the CPU ignores it
    (line,) = [d for d in describe(TrainConfig) if d.startswith("run.compile_attention ")]
    assert "required" not in line
    assert "false runs the dense SDPA path instead" in line
    assert "the CPU always runs the SDPA path" in line


def test_gamma_with_dpace_is_refused() -> None:
    # D-PACE's slot weights (training_slot_weights: 1 for every slot k >= 1) replace the
    # decay, so a gamma set beside it changed nothing, without a word
    message = problems_of("loss.weighting=dpace", "loss.gamma=3")
    assert (
        "loss: gamma=3.0 sets the decay weighting's slot weights, which weighting=dpace "
        "replaces (it would be ignored): unset loss.gamma (null), or set loss.weighting=decay"
    ) in message
    build_config(TrainConfig, None, "train", [*REQUIRED, "loss.weighting=dpace"])
    build_config(TrainConfig, None, "train", [*REQUIRED, "loss.gamma=3"])


def help_line(key: str) -> str:
    (line,) = [d for d in describe(TrainConfig) if d.startswith(f"{key} ")]
    return line


def test_max_steps_and_gamma_help_say_what_decides() -> None:
    # max_steps said "stop after this many optimizer steps", yet the run ends at
    # min(epochs x steps per epoch, max_steps) (train.py): max_steps=100000 at the default
    # 6 epochs trains 6 epochs. gamma's default named B = 16, 10, 8 only (else 7 * B / 16)
    assert "or after optim.epochs where that comes first" in help_line("optim.max_steps")
    line = help_line("loss.gamma")
    assert "of weighting=decay" in line and "else 7 * B / 16" in line


@pytest.mark.parametrize(
    "key",
    [
        "optim.lr",  # was AdamW's "Invalid learning rate: nan", once the model was built
        "run.time_limit_s",  # was no limit at all, without a word
        "loss.gamma",  # the rest trained NaN (or took NaN where a number was meant)
        "loss.distill_weight",
        "loss.distill_temperature",
        "optim.grad_clip",
        "optim.weight_decay",
        "drafter.rope_theta",
        "drafter.rms_norm_eps",
        "data.follow_poll_s",
    ],
)
def test_nan_is_refused_naming_the_key(key: str) -> None:
    # NaN passes a `<= 0` check: every comparison with it is false
    assert f"{key} must be a finite number, got nan" in problems_of(f"{key}=nan")
    assert f"{key} must be a finite number, got inf" in problems_of(f"{key}=inf")


def test_nan_in_betas_is_refused() -> None:
    assert "optim.betas must be a finite number, got [nan, 0.9]" in problems_of(
        "optim.betas=[.nan, 0.9]"
    )


def test_time_limit_help_says_where_its_clock_starts() -> None:
    # said "seconds of the training process", yet its clock starts at the training loop
    # (stop.StopRequests, made just before it; README: "from the start of the training loop"):
    # a 2 s limit after ~5 s of start-up stopped after 2 s of steps
    line = help_line("run.time_limit_s")
    assert "seconds of the training process" not in line
    assert "this many seconds of the training loop" in line
    assert "less the start-up before the loop" in line


def test_a_step_larger_than_the_training_sequences_is_warned_about(tmp_path: Path) -> None:
    """A step of more sequences than the store trains on pads the rest with zero-weight
    sequences, computed for nothing (3.5 GB instead of 0.39 GB on the example store, helper-104):
    trained as asked, with a warning naming the batch that fits."""
    from click.testing import CliRunner
    from log_capture import dflash_messages

    from dflash_offline.cli import main as cli
    from stage2_train.plan import EpochPlan

    assert EpochPlan(21, 1, 0, 4, 1, 0).padding_note() is None
    note = EpochPlan(21, 2, 0, 8, 2, 0).padding_note()
    assert note is not None and "takes 32 sequences" in note and "trains on 21: 11 of" in note
    assert "optim.batch_sequences=5" in note  # 2 x 5 x 2 = 20 <= 21
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=5))
    args = ["train", "--config", str(Path(__file__).parents[1] / "configs" / "debug.yaml")]
    args += ["--store", str(store), "--out", str(tmp_path / "run"), "--devices", "cpu"]
    sets = ["data.holdout_sequences=1", "optim.batch_sequences=6", "optim.max_steps=1"]
    with dflash_messages() as seen:
        result = CliRunner().invoke(cli, [*args, *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    assert any("takes 6 sequences" in m and "trains on 4: 2 of" in m for m in seen), seen
