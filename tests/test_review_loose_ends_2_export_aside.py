"""`dflash export RUN` and a checkpoint that a save killed mid-replace left only as
`.tmp-old-step-N` (folders of versions before the one-step swap, or of systems without it):
export listed `step-*` folders alone, so it exported an older step, or said "no checkpoint
step N", though train's leftover cleanup restores that folder as step N. It now renames it
back the same way, holding the run folder's lock; while a `dflash train` holds that lock it
renames nothing (the train may be between its two renames) and reads the folder where it lies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from log_capture import dflash_messages
from safetensors.torch import load_file

from common.durable import aside_name
from common.locks import exclusive_lock
from stage2_train.checkpoint import step_dir
from stage2_train.export import export_checkpoint
from stage2_train.model import DFlashDrafter, DrafterShape
from stage2_train.train import RUN_LOCK

SHAPE = DrafterShape(
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    num_tapped=2,
    block_size=4,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    vocab_size=50,
    mask_token_id=49,
)


def _checkpoint(run: Path, step: int, seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint of a tiny drafter at `step`, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    state = DFlashDrafter(SHAPE).state_dict()
    folder = step_dir(run, step)
    folder.mkdir(parents=True)
    torch.save(state, folder / "model.pt")
    target = {"tapped_layers": [1, 2], "config": {"num_hidden_layers": 4}}
    meta = {"train_state": {}, "config": {}, "shape": dataclasses.asdict(SHAPE), "target": target}
    meta |= {"mask_token": "<m>"}
    (folder / "meta.json").write_text(json.dumps(meta))
    return state


def _run_killed_mid_save(run: Path) -> dict[str, torch.Tensor]:
    """Steps 8 and 16, step 16 moved aside by a save of it killed between its two renames;
    the weights of step 16."""
    _checkpoint(run, 8, seed=1)
    newest = _checkpoint(run, 16, seed=2)
    os.rename(step_dir(run, 16), aside_name(step_dir(run, 16)))
    return newest


def _exported(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _same(exported: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(exported[k], v.to(torch.bfloat16)) for k, v in state.items())


def test_export_renames_the_newest_step_back_and_exports_it(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    newest = _run_killed_mid_save(run)
    with dflash_messages(logging.INFO) as seen:
        out = export_checkpoint(run)  # before: step 8's drafter
    assert _same(_exported(out), newest)
    assert step_dir(run, 16).is_dir() and not aside_name(step_dir(run, 16)).exists()
    assert any("renamed .tmp-old-step-000016" in m and "back to step-000016" in m for m in seen)


def test_export_of_that_step_by_number(tmp_path: Path) -> None:
    run = tmp_path / "run"
    newest = _run_killed_mid_save(run)
    # before: "no checkpoint step 16 to export; kept steps: 8"
    assert _same(_exported(export_checkpoint(run, 16, tmp_path / "e16")), newest)


def test_while_a_train_holds_the_run_it_reads_the_folder_where_it_lies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    newest = _run_killed_mid_save(run)
    aside = aside_name(step_dir(run, 16))
    with exclusive_lock(run / RUN_LOCK, ValueError), dflash_messages() as seen:
        out = export_checkpoint(run, None, tmp_path / "e")
    assert _same(_exported(out), newest)
    assert aside.is_dir() and not step_dir(run, 16).exists()  # renamed by no one but the train
    assert any(".tmp-old-step-000016" in m and "`dflash train` is running" in m for m in seen)


def test_the_export_command_logs_what_it_did(tmp_path: Path) -> None:
    """`dflash export` started no logger: its info lines (this rename) were dropped and its
    warnings came out bare through Python's last-resort handler, unlike every other command's."""
    import subprocess
    import sys

    run = tmp_path / "run"
    _run_killed_mid_save(run)
    done = subprocess.run(
        [sys.executable, "-m", "dflash_offline.cli", "export", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    [line] = [m for m in done.stderr.splitlines() if "renamed .tmp-old-step-000016" in m]
    assert line[:2].isdigit() and line[2] == ":"  # the logger's "HH:MM:SS message"
