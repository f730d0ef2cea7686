"""Export a trained drafter as the transformers-style folder serving engines load.

    dflash export RUN [--step N] [--out FOLDER] [--dtype bfloat16|float32|float16]

`RUN/export/` (written at the end of `dflash train`) holds `config.json` (a Qwen3 config of the
drafter's sizes plus `block_size`, `num_target_layers`, `dflash_config` with the mask token's id
and string, and `auto_map`), `model.safetensors` with exactly the key names of
notes/dflash.md (the layers, `norm`, `fc`, `hidden_norm`; no embedding and no LM head: the
target's are reused), in bf16 by default like the targets it serves, and `modeling_dflash.py`,
so that `AutoModel.from_pretrained(folder, trust_remote_code=True)` returns a DFlash drafter.
Every file is world-readable (0644): servers often run under another uid. The folder is written
next to its final place and renamed, so a reader never sees half an export; a disk full there
is one OutOfSpaceError naming the folder and the space needed.

`dflash export RUN` counts a step that a save killed mid-replace left only as
`.tmp-old-step-N` (whole, as it was before that save): it renames it back holding the run
folder's lock, as train's leftover cleanup does, or reads it where it lies while a `dflash
train` holds that lock.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from common.durable import aside_name, recover_aside, replace_folder, space_checked
from common.locks import exclusive_lock
from common.logging import get_logger
from common.target_config import last_layer_tapped_note
from stage2_train.checkpoint import (
    STEP_RE,
    DamagedCheckpoint,
    list_checkpoints,
    moved_aside,
    read_meta,
    read_model_state,
    step_dir,
)
from stage2_train.mask_token import checkpoint_mask_token
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


# the config.json key naming the target the export's training store came from (not read by
# servers): {name_or_path, weights_sha256}
TRAINED_FOR_KEY = "dflash_offline_target"


def expected_keys(num_layers: int) -> set[str]:
    """The tensor names a DFlash drafter folder must hold (notes/dflash.md)."""
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}
    return keys | {"norm.weight", "fc.weight", "hidden_norm.weight"}


MODEL_FILE = Path(__file__).with_name("modeling_dflash.py")
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
FILE_MODE, FOLDER_MODE = 0o644, 0o755


def export_drafter(
    model: DFlashDrafter,
    shape: DrafterShape,
    tapped_layers: list[int],
    target_config: dict,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    mask_token: str | None = None,
    fix: str = "free space or pass another --out, then export again",
    target: dict[str, Any] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write config.json, model.safetensors (in `dtype`) and modeling_dflash.py of `model` into
    `out_dir` (replacing it); `fix` ends the message of a disk-full error. `target`
    (`trained_for`): the target whose store trained it, recorded for evaluate's check.
    `extra_files`: name -> text written beside them, in the same rename (export-best's
    best.json: a folder never holds the drafter without its record)."""
    out_dir = Path(out_dir)
    dtype = EXPORT_DTYPES[dtype] if isinstance(dtype, str) else dtype
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    missing = expected_keys(shape.num_layers) ^ set(state)
    assert not missing, f"drafter state dict differs from the export format: {sorted(missing)}"
    config = drafter_config_json(shape, tapped_layers, target_config)
    config["block_size"] = shape.block_size
    config["dflash_config"].update(block_size=shape.block_size, mask_token=mask_token)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    config["auto_map"] = AUTO_MAP
    if target is not None:
        # servers read dflash_config and the model keys; this one is for dflash evaluate
        config[TRAINED_FOR_KEY] = target
    warn_last_layer_tapped(tapped_layers, config["num_target_layers"])
    check_export_target(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    needed = sum(v.numel() * v.element_size() for v in state.values())
    try:
        with space_checked("export", out_dir, needed, fix):
            tmp.mkdir(parents=True)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            shutil.copyfile(MODEL_FILE, tmp / MODEL_FILE.name)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            for path in tmp.iterdir():
                path.chmod(FILE_MODE)
            tmp.chmod(FOLDER_MODE)
            replace_folder(tmp, out_dir)  # the old export moved aside, not deleted first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# the (tapped layers, layer count) pairs already warned about: export-best exports the same
# drafter's shape again at every improvement, and one warning a run says it
_warned_last_layer: set[tuple[tuple[int, ...], int | None]] = set()


def warn_last_layer_tapped(tapped_layers: list[int], num_target_layers: int | None) -> None:
    """Warn, once per process and layout, when the drafter reads the target's last layer, which
    vLLM and SGLang do not give as training read it (common.target_config.last_layer_tapped_note)."""
    key = (tuple(tapped_layers), num_target_layers)
    note = last_layer_tapped_note(tapped_layers, num_target_layers)
    if note is None or key in _warned_last_layer:
        return
    _warned_last_layer.add(key)
    get_logger().warning("export: %s", note)


def trained_for(store_attrs: dict[str, Any]) -> dict[str, Any]:
    """What names the target a store was extracted from (its attributes): the model as given
    and, for a local folder, its weights' sha256 (FORMAT.md `fingerprints`; None for a hub id
    or a store written before fingerprints)."""
    prints = store_attrs.get("fingerprints")
    digest = prints.get("target_weights_sha256") if isinstance(prints, dict) else None
    return {"name_or_path": store_attrs["target"]["name_or_path"], "weights_sha256": digest}


def target_identity(name_or_path: str, weights_sha256: str | None) -> tuple[str, str]:
    """What a target is known by: ("weights", a local folder's digest) or ("hub ids", the hub
    id, lowercased: extract records no digest for one). Only two of one kind compare: a folder
    may hold a hub id's download."""
    return ("weights", weights_sha256) if weights_sha256 else ("hub ids", name_or_path.lower())


def other_target(drafter_config: dict[str, Any], name: str, weights_sha256: str | None) -> str:
    """Why the target `name` (weights `weights_sha256`, None when unknown) is not the one the
    export's store came from, or "" when it is, or when either side cannot tell (an export
    from before the record, a hub id beside a local folder: `target_identity`)."""
    recorded = drafter_config.get(TRAINED_FOR_KEY)
    if not isinstance(recorded, dict):
        return ""
    trained = str(recorded.get("name_or_path"))
    kind, known = target_identity(trained, recorded.get("weights_sha256"))
    given_kind, given = target_identity(name, weights_sha256)
    if given_kind != kind or given == known:
        return ""
    if kind == "weights":
        return f"trained for {trained} (weights sha256 {known[:12]}), not {name} ({given[:12]})"
    return f"trained for {trained}, not {name}"


def check_export_target(out_dir: Path) -> None:
    """Refuse to replace a folder that is not a drafter export (a run folder, a folder of
    other files, one above them): an export replaces its folder whole."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return
    try:
        is_export = "dflash_config" in json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        is_export = False
    if not is_export:
        raise ValueError(
            f"--out {out_dir} exists and is not a drafter export (no config.json with "
            "dflash_config): an export replaces its folder whole, so pass a new folder or an "
            "earlier export's"
        )


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


def not_an_export_fix(folder: Path) -> str:
    """What to pass instead of `folder` as a drafter, by what it is (a run folder or one of
    its checkpoints: the slips a user makes after `dflash train`)."""
    step = STEP_RE.match(folder.name)
    if step and folder.is_dir():
        return (
            f"this is a training checkpoint: export it with `dflash export {folder.parent} "
            f"--step {int(step.group(1))} --out FOLDER` and pass FOLDER"
        )
    if (folder / "export" / "config.json").is_file():
        return f"this is a training run: pass its export, {folder / 'export'}"
    if list_checkpoints(folder):
        return f"this is a training run: export it with `dflash export {folder}` first"
    return "pass an export folder (RUN/export, or `dflash export RUN`)"


def read_export_config(folder: str | Path) -> dict:
    """The config.json of an export folder; ValueError naming the fix when the folder is not
    one (config.json or model.safetensors missing, or a config without dflash_config: a
    target model's folder, say)."""
    folder = Path(folder)
    missing = [n for n in ("config.json", "model.safetensors") if not (folder / n).is_file()]
    if missing:
        raise ValueError(
            f"drafter {folder}: {', '.join(missing)} missing; {not_an_export_fix(folder)}"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"drafter {folder}: config.json is unreadable ({err}); export it again with "
            "`dflash export RUN --out FOLDER`"
        ) from err
    # a model folder of any other kind (the target's, passed for the drafter) has both files
    # too: without this, the first read of dflash_config failed as a KeyError, a bug's exit
    if not isinstance(config, dict) or not isinstance(config.get("dflash_config"), dict):
        raise ValueError(
            f"drafter {folder}: its config.json has no dflash_config, so it is no DFlash "
            "drafter (a target model's folder?); pass an export folder (RUN/export, or "
            "`dflash export RUN`)"
        )
    return config


def load_export(folder: str | Path) -> DFlashDrafter:
    """A DFlashDrafter rebuilt from an export folder (weights in the exported dtype)."""
    folder = Path(folder)
    model = DFlashDrafter(shape_from_export(read_export_config(folder)))
    state = load_file(str(folder / "model.safetensors"))
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True)
    return model


def served_copy(
    model: DFlashDrafter,
    dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """A detached copy of `model` as `dflash evaluate` runs its export: every weight rounded to
    the export's `dtype`, then held in `compute_dtype` (the training parameters stay as they
    are). Costs one `compute_dtype` copy of the weights while it lives."""
    with torch.device("meta"):
        twin = DFlashDrafter(model.shape)
    state = {k: v.detach().to(dtype).to(compute_dtype) for k, v in model.state_dict().items()}
    twin.load_state_dict(state, strict=True, assign=True)
    return twin.eval()


def checkpoint_folders(run: str | Path) -> dict[int, Path]:
    """The kept checkpoints of `run` by step, oldest first: its `step-N` folders, and a step
    left only as `.tmp-old-step-N` (checkpoint.moved_aside) where it lies."""
    found = {int(STEP_RE.match(p.name).group(1)): p for p in list_checkpoints(run)}
    return dict(sorted((moved_aside(run) | found).items()))


class _TrainRunning(Exception):
    """A `dflash train` holds the run folder's lock; the message names it."""


def recover_moved_aside(run: str | Path) -> None:
    """Rename the steps of `run` left only as `.tmp-old-step-N` back to `step-N`, as train's
    leftover cleanup does (checkpoint.remove_leftovers), holding the run folder's lock for it:
    a `dflash train` between the two renames of a save would find `step-N` taken and fail.
    While a train holds the lock, or where the folder cannot be renamed (another user's run),
    they stay where they are, said in the log: the export reads them there."""
    asides = moved_aside(run)
    if not asides:
        return
    from stage2_train.train import RUN_LOCK  # (train imports this module)

    run, log = Path(run), get_logger()
    names = ", ".join(p.name for p in asides.values())

    def refused(holder: str) -> Exception:
        return _TrainRunning(holder)

    try:
        with exclusive_lock(run / RUN_LOCK, refused):
            for step in asides:
                final = step_dir(run, step)
                if recover_aside(final):
                    log.info(
                        "export: renamed %s in %s back to %s (a killed save had moved it aside)",
                        aside_name(final).name,
                        run,
                        final.name,
                    )
    except _TrainRunning as err:
        log.warning(
            "export: %s in %s left by a save (killed, or under way) not renamed back: a "
            "`dflash train` is running in this run folder (%s) and renames it back or replaces "
            "it itself; read where it lies",
            names,
            run,
            err,
        )
    except OSError as err:
        log.warning(
            "export: %s in %s (a step a killed save moved aside, whole) could not be renamed "
            "back (%s); read where it lies. Rename it to its step-* name (drop the .tmp-old- "
            "prefix), or rerun the run's `dflash train`, which does so as it starts",
            names,
            run,
            err,
        )


def no_checkpoint_fix(run: str | Path, step: int | None) -> str:
    """What to pass instead, by what `run` is (the mistakes a user makes with `dflash export`)."""
    run = Path(run)
    if not run.is_dir():
        return "no such folder: pass the run folder `dflash train --out` wrote"
    if STEP_RE.match(run.name):
        return f"this is one checkpoint: pass its run folder, {run.parent}, with --step N"
    if (run / "config.json").is_file() and (run / "model.safetensors").is_file():
        return "this is already an export (config.json and model.safetensors): load it as it is"
    kept = list(checkpoint_folders(run))
    if kept:  # only a --step that is not kept gets here
        return f"kept steps: {', '.join(map(str, kept))} (run.keep_checkpoints sets how many stay)"
    return "pass the run folder `dflash train --out` wrote, after its first checkpoint"


def exportable_steps(run: str | Path, but: Path) -> list[int]:
    """The kept checkpoints of `run` other than `but` that look whole to `dflash export` (a
    meta.json that reads, a model.pt that is not empty; its tensors are read only when one is
    exported: a drafter's may be gigabytes)."""
    steps = []
    for step, path in checkpoint_folders(run).items():
        try:
            read_meta(path)
        except DamagedCheckpoint:
            continue
        model = path / "model.pt"
        if path != but and model.is_file() and model.stat().st_size > 0:
            steps.append(step)
    return steps


def damaged_fix(run: str | Path, ckpt: Path) -> str:
    """What to export instead of the damaged checkpoint `ckpt`: the other kept steps, each as
    its command (newest first), or how to get one when there is none."""
    steps = exportable_steps(run, ckpt)[::-1]
    if not steps:
        return (
            "no other kept checkpoint of this run looks whole to export; rerun its `dflash "
            "train` command (it resumes from the newest readable checkpoint, or starts afresh "
            "when none is) and export after its next checkpoint"
        )
    commands = " or ".join(f"`dflash export {run} --step {n}`" for n in steps[:3])
    more = f" (kept steps: {', '.join(map(str, steps))})" if len(steps) > 3 else ""
    return f"export another kept checkpoint: {commands}{more}"


def export_checkpoint(
    run: str | Path,
    step: int | None = None,
    out: str | Path | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """Export the drafter of checkpoint `step` (default: the newest) of run folder `run`; a
    step a killed save left only as `.tmp-old-step-N` counts (`recover_moved_aside`)."""
    recover_moved_aside(run)
    folders = checkpoint_folders(run)
    ckpt = folders.get(step) if step is not None else folders[max(folders)] if folders else None
    if ckpt is None:
        which = f"step {step} " if step is not None else ""
        raise ValueError(f"{run}: no checkpoint {which}to export; {no_checkpoint_fix(run, step)}")
    try:
        meta = read_meta(ckpt)
        state = read_model_state(ckpt)
        try:
            shape = DrafterShape(**meta["shape"])
            target = meta["target"]
            tapped_layers, target_config = target["tapped_layers"], target["config"]
        except (KeyError, TypeError) as err:
            raise DamagedCheckpoint(f"meta.json lacks the drafter's {err}") from err
        model = DFlashDrafter(shape)
        try:
            model.to(next(iter(state.values())).dtype).load_state_dict(state)
        except (StopIteration, AttributeError, RuntimeError) as err:
            # load_state_dict's lines name each missing, unexpected or mis-sized tensor
            what = " ".join(line.strip() for line in str(err).splitlines()) or repr(err)
            cut = what[:300] + (" ..." if len(what) > 300 else "")
            raise DamagedCheckpoint(f"model.pt does not hold the drafter ({cut})") from err
    except DamagedCheckpoint as err:
        raise ValueError(f"checkpoint {ckpt} is damaged ({err}); {damaged_fix(run, ckpt)}") from err
    out = Path(out or Path(run) / "export")
    return export_drafter(
        model,
        shape,
        tapped_layers,
        target_config,
        out,
        dtype=dtype,
        mask_token=checkpoint_mask_token(meta, shape.mask_token_id),
        fix=f"free space or pass another --out, then rerun `dflash export {run}`",
        # checkpoints from before the record name no target: their exports have none
        target=target.get("trained_for"),
    )
