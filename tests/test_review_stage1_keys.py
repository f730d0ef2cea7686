"""`dflash extract` and `dflash generate` keys whose bad values passed the config checks and
failed (or went on) only after the target loaded and --out was made: each is now refused when
the config is built, naming the key, the value and the fix."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from common.config import build_config
from dflash_offline.cli import main as cli
from stage1_extract.config import ExtractConfig
from stage1_extract.writer import ShardLayout, chunk_codecs
from stage1_generate.config import GenerateConfig

REQUIRED = ["target.model=m", "data.path=d", "store.out=s"]


@pytest.mark.parametrize(
    ("level", "shuffle"), [(10, True), (22, True), (-1, True), (23, False), (30, False)]
)
def test_a_compression_level_the_codecs_refuse_is_a_config_error(level: int, shuffle: bool) -> None:
    """Blosc (the byte-shuffled float arrays) encodes at 0..9 only and zstd up to 22: past them
    the first shard failed to encode ("error during blosc compression: -10", as a bug)."""
    sets = [*REQUIRED, f"store.compression_level={level}", f"store.byte_shuffle={shuffle}"]
    with pytest.raises(ValueError, match=rf"compression_level must .* got {level}"):
        build_config(ExtractConfig, None, "extract", sets)


@pytest.mark.parametrize(("level", "shuffle"), [(9, True), (0, True), (22, False), (-3, False)])
def test_the_levels_taken_encode(tmp_path, level: int, shuffle: bool) -> None:  # noqa: ANN001
    sets = [*REQUIRED, f"store.compression_level={level}", f"store.byte_shuffle={shuffle}"]
    store = build_config(ExtractConfig, None, "extract", sets).store
    layout = ShardLayout(128, 128, store.compression_level, store.byte_shuffle)
    values = np.random.default_rng(0).random(256, dtype=np.float32)
    array = zarr.create_array(
        tmp_path / "a",
        shape=values.shape,
        dtype=values.dtype,
        chunks=(128,),
        compressors=chunk_codecs("topk_logits", 4, 512, layout),
        zarr_format=3,
    )
    array[:] = values
    assert (array[:] == values).all()


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("sampling.temperature=.nan", "sampling.temperature must be a finite number, got nan"),
        ("sampling.temperature=.inf", "sampling.temperature must be a finite number, got inf"),
        ("sampling.temperature=-1", "sampling: temperature must be >= 0, got -1"),
        ("sampling.seed=100000000000000000000000", "sampling: seed must be within"),
        ("sampling.seed=-9223372036854775809", "sampling: seed must be within"),
    ],
)
def test_sampling_values_the_target_cannot_take_are_config_errors(setting: str, named: str) -> None:
    """A NaN temperature passed `< 0` and failed in transformers once the target had loaded,
    an infinite one sampled uniformly (rows of noise, no error), a seed past 64 bits failed
    in torch.manual_seed at the first chunk: each after --out was made. One problem, one line
    (a non-finite temperature was reported by generate's check and the shared one both)."""
    sets = ["target.model=m", "data.path=d", "output.out=o", setting]
    with pytest.raises(ValueError, match=re.escape(named)) as raised:
        build_config(GenerateConfig, None, "generate", sets)
    assert str(raised.value).count("\n  - ") == 1


def test_the_widest_seeds_and_a_tiny_temperature_are_taken() -> None:
    for setting in ("seed=-9223372036854775808", "seed=9223372036854775807", "temperature=1e-30"):
        sets = ["target.model=m", "data.path=d", "output.out=o", f"sampling.{setting}"]
        build_config(GenerateConfig, None, "generate", sets)


CASES = [("extract", "bogus"), ("generate", "bogus"), ("extract", "sdpa_gqa_decode")]
if importlib.util.find_spec("flash_attn") is None:  # refused here for its missing package
    CASES += [("extract", "flash_attention_2"), ("generate", "flash_attention_2")]


@pytest.mark.parametrize(("command", "backend"), CASES)
def test_an_attention_backend_the_target_cannot_run_is_refused_before_out(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, backend: str
) -> None:
    """transformers refused it as the weights loaded, after --out was made, naming no key
    (flash_attention_2 without its package as a bug, exit 1); now from the config, on the meta
    device, before --out. sdpa_gqa_decode is generate's own (its decode steps, registered
    there): extract refuses it."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("loaded the target's weights past the point of refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    if backend == "sdpa_gqa_decode":
        # registered with transformers once generate's module is imported, as an earlier test
        # in this process may have done (the CI's order): extract refuses it all the same
        import stage1_generate.gqa_decode  # noqa: F401
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "hello there, a short document"}) + "\n")
    out = tmp_path / "out"
    args = [command, "--model", str(tiny_qwen3), "--data", str(data), "--out", str(out)]
    args += ["--devices", "cpu", "--set", f"target.attn_implementation={backend}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith(f"error: target.attn_implementation='{backend}' cannot run ")
    assert "--set target.attn_implementation=sdpa" in errors[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("changed", "named", "set_back"),
    [
        ("store.chunk_tokens=16", "store.chunk_tokens (32 -> 16)", "store.chunk_tokens=32"),
        (
            "packing.overlong=truncate",
            "packing.overlong ('split' -> 'truncate')",
            "packing.overlong=split",
        ),
        ("data.on_invalid=skip", "data.on_invalid ('error' -> 'skip')", "data.on_invalid=error"),
    ],
)
def test_a_refused_resume_names_the_key_and_both_values(
    tiny_qwen3: Path, tmp_path: Path, changed: str, named: str, set_back: str
) -> None:
    """A rerun with one store.*, packing.* or data.* key changed was refused naming only the
    section ("extract_config.store differ", "data settings differ"), where generate and train
    name the key and both values; now so does extract, with the --set that resumes."""
    from stage1_extract.run import run_extract
    from tests.test_extract import make_config, write_data

    data, out = write_data(tmp_path, num_rows=2), tmp_path / "store"
    run_extract(make_config(tiny_qwen3, data, out))
    with pytest.raises(ValueError, match="written with other settings") as refused:
        run_extract(make_config(tiny_qwen3, data, out, changed))
    message = str(refused.value)
    assert f"({named} differ)" in message, message
    assert f"to resume it, rerun with --set {set_back};" in message, message
    run_extract(make_config(tiny_qwen3, data, out, changed, set_back))  # it resumes
