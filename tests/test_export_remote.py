"""The export loads as-is: `AutoModel.from_pretrained(folder, trust_remote_code=True)` gives a
DFlash drafter (no missing or unexpected keys) that drafts what the trainer's drafter drafts,
and whose `spec_generate` decodes exactly the target's greedy text."""

from __future__ import annotations

import json
import stat
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from store_factory import FactorySpec, build_store
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

from common.config import build_config
from evaluation.dflash_draft import dflash_draft_fn
from stage2_train.config import DrafterConfig, TrainConfig
from stage2_train.export import expected_keys, export_checkpoint, export_drafter
from stage2_train.model import DFlashDrafter, DrafterShape, drafter_shape
from stage2_train.step import load_frozen_head
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote")
    store = build_store(root / "store", FactorySpec(num_sequences=7))
    sets = [f"data.store={store}", f"run.out={root / 'run'}", "run.progress=false"]
    sets += ["optim.max_steps=6", "optim.lr=1e-2"]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    return root


def test_export_is_bf16_world_readable_with_auto_map(run: Path) -> None:
    folder = run / "run" / "export"  # the one train wrote at the end
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "model.safetensors", "modeling_dflash.py"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in folder.iterdir())
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["torch_dtype"] == "bfloat16" and "mask_token" in config["dflash_config"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = f.keys()  # safe_open is not iterable
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}


def test_auto_model_drafts_what_the_trainer_drafts(run: Path) -> None:
    folder = export_checkpoint(run / "run", dtype="float32", out=run / "export-fp32")
    model, info = AutoModel.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True
    )
    assert type(model).__name__ == "DFlashDraftModel"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert set(model.state_dict()) == expected_keys(2)
    meta = json.loads((run / "run" / "step-000006" / "meta.json").read_text())
    trainer = DFlashDrafter(DrafterShape(**meta["shape"]))
    trainer.load_state_dict(torch.load(run / "run" / "step-000006" / "model.pt"))
    head = load_frozen_head(run / "store", torch.device("cpu"), torch.float32)
    shape = trainer.shape
    torch.manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (40,)).tolist()
    feats_TKD = torch.randn(39, shape.num_tapped, shape.hidden_size)
    reference = dflash_draft_fn(trainer, head.embed_VD, head.lm_head_VD)
    cache, cached = DynamicCache(), 0
    for end in (12, 13, 20, 40):  # a sequence growing by 1, 7 and 20 accepted tokens
        expected = reference(tokens[:end], feats_TKD[: end - 1])
        new = feats_TKD[cached : end - 1].flatten(1)[None]
        last = torch.tensor([tokens[end - 1]])
        drafted = model.draft_block(new, last, end - 1, head.embed_VD, head.lm_head_VD, cache)
        assert drafted[0].tolist() == expected
        cached = end - 1
    # without a cache: the whole context at once
    whole = model.draft_block(feats_TKD.flatten(1)[None], last, 39, head.embed_VD, head.lm_head_VD)
    assert whole[0].tolist() == expected


def test_spec_generate_equals_the_targets_greedy_text(tiny_qwen3: Path, tmp_path: Path) -> None:
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3).eval()
    config = target.config.to_dict()
    shape = drafter_shape(
        DrafterConfig(num_layers=1, block_size=4), config, 2, config["vocab_size"], 3
    )
    torch.manual_seed(0)
    folder = export_drafter(
        DFlashDrafter(shape), shape, [0, 2], config, tmp_path / "export", dtype="float32"
    )
    draft = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    prompt = torch.tensor([[5, 17, 9, 23, 5, 17]])
    greedy = target.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    with warnings.catch_warnings():
        # the target's cache under the name its forward takes: no deprecated keyword (it goes
        # in transformers 5.40 and would break an exported folder's spec_generate)
        warnings.simplefilter("error", FutureWarning)
        spec = draft.spec_generate(target, prompt, max_new_tokens=12)
    assert spec.tolist() == greedy.tolist()
