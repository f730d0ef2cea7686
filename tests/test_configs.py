"""Every YAML in configs/ loads into its dataclasses; overrides and validation behave."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import build_config, describe, parse_overrides
from stage1_extract.config import ExtractConfig
from stage1_generate.config import GenerateConfig
from stage2_train.config import TrainConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
REQUIRED = {
    "generate": ["target.model=m", "data.path=d", "output.out=o"],
    "extract": ["target.model=m", "data.path=d", "store.out=o"],
    "train": ["data.store=s", "run.out=o"],
}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    extract = build_config(ExtractConfig, path, "extract", REQUIRED["extract"])
    train = build_config(TrainConfig, path, "train", REQUIRED["train"])
    generate = build_config(GenerateConfig, path, "generate", REQUIRED["generate"])
    assert generate.sampling.max_new_tokens >= 1
    assert extract.packing.seq_len >= 16
    assert train.drafter.block_size >= 2


def test_qwen3_8b_has_the_paper_values() -> None:
    path = Path(__file__).parent.parent / "configs" / "qwen3-8b.yaml"
    cfg = build_config(ExtractConfig, path, "extract", REQUIRED["extract"][1:])
    assert cfg.target.tapped_layers == [1, 9, 17, 25, 33]
    assert cfg.packing.seq_len == 3072


def test_overrides_are_typed_and_nested() -> None:
    cfg = build_config(
        ExtractConfig,
        None,
        "extract",
        [*REQUIRED["extract"], "packing.seq_len=4096", "target.tapped_layers=[2, 4]"],
    )
    assert cfg.packing.seq_len == 4096
    assert cfg.target.tapped_layers == [2, 4]
    assert parse_overrides(["a.b=true"]) == {"a": {"b": True}}
    train = build_config(TrainConfig, None, "train", [*REQUIRED["train"], "optim.lr=2e-3"])
    assert train.optim.lr == 0.002


def test_unknown_key_and_bad_type_are_named() -> None:
    with pytest.raises(ValueError, match="packing.seq_lenn"):
        build_config(ExtractConfig, None, "extract", ["packing.seq_lenn=1"])
    with pytest.raises(ValueError, match="packing.seq_len: expected an integer"):
        build_config(ExtractConfig, None, "extract", ["packing.seq_len=abc"])


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ValueError) as err:
        build_config(ExtractConfig, None, "extract", ["packing.seq_len=2"])
    message = str(err.value)
    for needle in ("target: model is required", "data: path is required", "seq_len must be"):
        assert needle in message


def test_describe_lists_every_leaf_field() -> None:
    lines = describe(TrainConfig)
    assert any(line.startswith("optim.lr (float") for line in lines)
    assert any(line.startswith("drafter.mask_token_id") for line in lines)


def test_text_fields_keep_their_text_and_bad_yaml_is_a_user_error(tmp_path: Path) -> None:
    """Paths and names are not parsed as YAML (`--out 0123` was the folder 83, `runs/exp #2`
    was cut at the '#'); a value or config file that is not YAML is one ValueError naming it
    (a user error, exit 2), not a parser traceback."""
    cfg = build_config(
        TrainConfig, None, "train", ["run.out=0123", "data.store=runs/exp #2", "optim.lr=2e-3"]
    )
    assert cfg.run.out == "0123" and cfg.data.store == "runs/exp #2" and cfg.optim.lr == 2e-3
    no_dev = build_config(TrainConfig, None, "train", [*REQUIRED["train"], "data.dev_store=null"])
    assert no_dev.data.dev_store is None
    with pytest.raises(ValueError, match=r"--set optim.betas=\[0.9: not a YAML value"):
        build_config(TrainConfig, None, "train", ["optim.betas=[0.9"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  optim:\n    lr: 1\n   steps: 2\n")
    with pytest.raises(ValueError, match=f"config file {bad} is not valid YAML"):
        build_config(TrainConfig, bad, "train", [])


def test_step_counts_are_checked_and_train_paths_expand_home() -> None:
    """max_steps -1 (another trainer's "no limit") trained nothing and exported; log_every 0
    divided by zero; a negative cadence ran every step. `~` in train's paths is the home
    folder, as in extract's and generate's."""
    import os

    from stage2_train.train import expand_paths

    for setting, words in (
        ("optim.max_steps=-1", "max_steps must be >= 1"),
        ("run.log_every=0", "log_every must be >= 1"),
        ("run.eval_every=-1", "eval_every must be >= 0"),
        ("run.checkpoint_every=-2", "checkpoint_every must be >= 0"),
    ):
        with pytest.raises(ValueError, match=words):
            build_config(TrainConfig, None, "train", [*REQUIRED["train"], setting])
    sets = ["run.out=~/run", "data.store=~/store", "data.dev_store=~/dev"]
    cfg = expand_paths(build_config(TrainConfig, None, "train", sets))
    home = os.path.expanduser("~")
    assert (cfg.run.out, cfg.data.store, cfg.data.dev_store) == (
        f"{home}/run",
        f"{home}/store",
        f"{home}/dev",
    )


def test_loader_prefetch_is_checked_where_workers_use_it() -> None:
    """data.prefetch 0 with loader workers stopped at the loader with torch's bare
    AssertionError, a negative one with a ValueError naming prefetch_factor; without workers
    the loader never reads it, so any value is left alone."""
    for value in ("0", "-3"):
        setting = ["data.num_workers=2", f"data.prefetch={value}"]
        with pytest.raises(ValueError, match=rf"data: prefetch must be >= 1 .*got {value}"):
            build_config(TrainConfig, None, "train", [*REQUIRED["train"], *setting])
    sets = [*REQUIRED["train"], "data.num_workers=0", "data.prefetch=0"]
    assert build_config(TrainConfig, None, "train", sets).data.prefetch == 0
