"""Export a trained drafter as the transformers-style folder serving engines load.

    python -m stage2_train.export RUN [--step N] [--out FOLDER]   # on demand, from a checkpoint

`RUN/export/` (written at the end of `dflash train`) holds `config.json` (a Qwen3 config of the
drafter's sizes plus `block_size`, `num_target_layers` and `dflash_config`) and
`model.safetensors` with exactly the key names of notes/dflash.md: the layers, `norm`, `fc`,
`hidden_norm`; no embedding and no LM head (the target's are reused). The folder is written
next to its final place and renamed, so a reader never sees half an export.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.durable import commit_folder
from stage2_train.checkpoint import latest_checkpoint, step_dir
from stage2_train.model import DFlashDrafter, DrafterShape, drafter_config_json

LAYER_KEYS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def expected_keys(num_layers: int) -> set[str]:
    """The tensor names a DFlash drafter folder must hold (notes/dflash.md)."""
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}
    return keys | {"norm.weight", "fc.weight", "hidden_norm.weight"}


def export_drafter(
    model: DFlashDrafter,
    shape: DrafterShape,
    tapped_layers: list[int],
    target_config: dict,
    out_dir: str | Path,
) -> Path:
    """Write config.json + model.safetensors of `model` into `out_dir` (replacing it)."""
    out_dir = Path(out_dir)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    missing = expected_keys(shape.num_layers) ^ set(state)
    assert not missing, f"drafter state dict differs from the export format: {sorted(missing)}"
    config = drafter_config_json(shape, tapped_layers, target_config)
    config["block_size"] = shape.block_size
    config["dflash_config"]["block_size"] = shape.block_size
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    commit_folder(tmp, out_dir)
    return out_dir


def shape_from_export(config: dict) -> DrafterShape:
    """The DrafterShape an exported config.json describes (for reloading an export)."""
    return DrafterShape(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        num_tapped=len(config["dflash_config"]["target_layer_ids"]),
        block_size=config["dflash_config"]["block_size"],
        rope_theta=config["rope_theta"],
        rms_norm_eps=config["rms_norm_eps"],
        vocab_size=config["vocab_size"],
        mask_token_id=config["dflash_config"]["mask_token_id"],
    )


def read_export_config(folder: str | Path) -> dict:
    """The config.json of an export folder; ValueError naming the fix when the folder is not
    one (config.json or model.safetensors missing)."""
    folder = Path(folder)
    missing = [n for n in ("config.json", "model.safetensors") if not (folder / n).is_file()]
    if missing:
        raise ValueError(
            f"drafter {folder}: {', '.join(missing)} missing; pass an export folder "
            "(RUN/export, or `dflash export RUN`)"
        )
    return json.loads((folder / "config.json").read_text())


def load_export(folder: str | Path) -> DFlashDrafter:
    """A DFlashDrafter rebuilt from an export folder (weights in the exported dtype)."""
    folder = Path(folder)
    model = DFlashDrafter(shape_from_export(read_export_config(folder)))
    state = load_file(str(folder / "model.safetensors"))
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True)
    return model


def export_checkpoint(
    run: str | Path, step: int | None = None, out: str | Path | None = None
) -> Path:
    """Export the drafter of checkpoint `step` (default: the newest) of run folder `run`."""
    ckpt = step_dir(run, step) if step is not None else latest_checkpoint(run)
    if ckpt is None or not ckpt.is_dir():
        raise ValueError(f"{run}: no checkpoint {'step ' + str(step) if step else ''} to export")
    meta = json.loads((ckpt / "meta.json").read_text())
    shape = DrafterShape(**meta["shape"])
    model = DFlashDrafter(shape)
    state = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    model.to(next(iter(state.values())).dtype).load_state_dict(state)
    target = meta["target"]
    return export_drafter(
        model, shape, target["tapped_layers"], target["config"], out or Path(run) / "export"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="export a drafter from a run's checkpoint")
    parser.add_argument("run", help="run folder (dflash train --out)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default newest)")
    parser.add_argument("--out", default=None, help="export folder (default RUN/export)")
    args = parser.parse_args()
    print(f"exported to {export_checkpoint(args.run, args.step, args.out)}")


if __name__ == "__main__":
    main()
