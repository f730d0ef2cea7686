"""Review (stage 2 walked through as a new user): the wrong folder given to `dflash evaluate` /
`evaluate-offline`, and a resume that names the layers it already reads.

- `--drafter` a target model's folder (config.json and model.safetensors, no dflash_config)
  failed as `KeyError: 'dflash_config'`, a bug's exit; a run folder or one of its checkpoints
  was told to pass "an export folder" without saying which or how: each is now named.
- `--target` a drafter export was refused as a target "with 2 layers" (the drafter's own);
  it is now named as an export, before any weights load.
- `--data` a store failed in a pyarrow cast of its zarr.json files; it is named as a store,
  with `dflash evaluate-offline` for it.
- A resume with `data.tapped_layers` naming every layer of the store (unset before, or the
  other way round) was refused as a change of the drafter's input, which it is not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from store_factory import FactorySpec, build_store
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import build_config
from dflash_offline.cli import main as cli
from evaluation.online import EvaluateConfig, load_prompts, run_evaluate
from stage2_train.config import DrafterConfig, TrainConfig
from stage2_train.export import export_drafter, read_export_config
from stage2_train.model import DFlashDrafter, drafter_shape
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


def error_line(result: Any) -> str:
    """The output's one `error:` line, of a user's error (exit 2, no traceback)."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "Traceback" not in result.output and "KeyError" not in result.output, result.output
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("s") / "store", FactorySpec(num_sequences=4))


def _export(target: Path, folder: Path) -> Path:
    config = AutoModelForCausalLM.from_pretrained(target).config.to_dict()
    shape = drafter_shape(DrafterConfig(num_layers=1, block_size=4), config, 2, 512, 3)
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(shape), shape, [0, 2], config, folder)


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "dev.jsonl"
    path.write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    return path


def test_a_target_folder_for_the_drafter_is_named_not_a_key_error(
    tiny_qwen3: Path, store: Path, tmp_path: Path
) -> None:
    evaluate = ["evaluate", "--target", str(tiny_qwen3), "--drafter", str(tiny_qwen3)]
    result = CliRunner().invoke(cli, [*evaluate, "--data", str(_data(tmp_path))])
    assert f"drafter {tiny_qwen3}: its config.json has no dflash_config" in error_line(result)
    offline = ["evaluate-offline", "--drafter", str(tiny_qwen3), "--store", str(store)]
    assert "no DFlash drafter" in error_line(CliRunner().invoke(cli, offline))


def test_a_run_folder_or_checkpoint_for_the_drafter_names_what_to_pass(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "step-000040").mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"export it with `dflash export {run}` first"):
        read_export_config(run)
    with pytest.raises(ValueError, match=rf"`dflash export {run} --step 40 --out FOLDER`"):
        read_export_config(run / "step-000040")
    (run / "export").mkdir()
    (run / "export" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"training run: pass its export, {run / 'export'}"):
        read_export_config(run)


def test_an_export_for_the_target_is_named_before_weights_load(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export = _export(tiny_qwen3, tmp_path / "export")

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("weights loaded before the target was refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    cfg = EvaluateConfig(str(export), str(_data(tmp_path)), drafter=str(export))
    with pytest.raises(ValueError, match=rf"--target {export} is a DFlash drafter export"):
        run_evaluate(cfg)


def test_a_store_for_the_data_is_named_with_evaluate_offline(tiny_qwen3: Path, store: Path) -> None:
    cfg = EvaluateConfig(str(tiny_qwen3), str(store))
    with pytest.raises(ValueError, match=r"is a store \(zarr.json\), not prompts.*evaluate-off"):
        load_prompts(cfg, AutoTokenizer.from_pretrained(tiny_qwen3))


def test_naming_the_stores_layers_is_no_change_on_resume(tmp_path: Path) -> None:
    store = build_store(tmp_path / "store", FactorySpec(num_sequences=6, tapped_layers=[0, 2]))
    out = tmp_path / "run"
    sets = [f"data.store={store}", f"run.out={out}", "run.progress=false", "run.eval_every=0"]
    sets += ["data.holdout_sequences=2", "run.checkpoint_every=2"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*sets, "optim.max_steps=2"]))
    named = [*sets, "optim.max_steps=4", "run.allow_config_change=true"]
    run_train(build_config(TrainConfig, DEBUG, "train", [*named, "data.tapped_layers=[0,2]"]))
    assert (out / "step-000004").is_dir()
    # and back: unset again after a checkpoint that names them
    run_train(build_config(TrainConfig, DEBUG, "train", [*sets, "optim.max_steps=6", *named[-1:]]))
    assert (out / "step-000006").is_dir()
    with pytest.raises(ValueError, match=r"data.tapped_layers: None -> \[2\]"):
        run_train(build_config(TrainConfig, DEBUG, "train", [*named, "data.tapped_layers=[2]"]))


@pytest.mark.parametrize(
    "option, named",
    [("--num-anchors", "--num-anchors must be >= 1, got 0"), ("--max-sequences", "--max-seq")],
)
def test_evaluate_offline_counts_below_one_are_named_by_their_flag(
    store: Path, option: str, named: str
) -> None:
    # --num-anchors 0 failed as an AssertionError in the anchor sampler (a bug's exit), and
    # --max-sequences 0 as a store without sequences; refused before the drafter is read
    args = ["evaluate-offline", "--drafter", "/nonexistent", "--store", str(store)]
    line = error_line(CliRunner().invoke(cli, [*args, option, "0"]))
    assert line.startswith("error: invalid evaluate-offline settings") and named in line


def test_json_out_in_a_new_folder_is_written(tmp_path: Path) -> None:
    # evaluate-offline's --json-out in a folder not yet made failed once all was computed
    # (evaluate's worked: its plot, written first, made the folder)
    from dflash_offline.options import echo_json

    path = tmp_path / "new" / "offline.json"
    echo_json({"chained_tau": 1.5}, str(path))
    assert json.loads(path.read_text()) == {"chained_tau": 1.5}
