"""Checkpoints (atomic, pruned, full restore), the lr schedule, and the export round trip."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stage2_train.attention import BlockAttention
from stage2_train.checkpoint import (
    TrainState,
    fitted_end,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    remove_leftovers,
    save_checkpoint,
)
from stage2_train.config import DrafterConfig, OptimConfig
from stage2_train.export import expected_keys, export_drafter, load_export
from stage2_train.model import DFlashDrafter, drafter_shape
from stage2_train.schedule import FittedEnd, build_optimizer, build_scheduler, lr_factor


def _training_objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = build_optimizer(list(model.parameters()), OptimConfig(lr=0.1), torch.device("cpu"))
    scheduler = build_scheduler(optimizer, OptimConfig(lr=0.1, warmup_ratio=0.2), total_steps=20)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4)  # from the global RNG: its state must be restored too
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_checkpoint_restores_training_exactly_and_prunes(tmp_path: Path) -> None:
    model, opt, sched = _training_objects(0)
    _train(model, opt, sched, 3)
    for step in (3, 4, 5):
        if step > 3:
            _train(model, opt, sched, 1)
        save_checkpoint(
            tmp_path,
            TrainState(step, 0, step),
            model=model,
            optimizer=opt,
            scheduler=sched,
            config={"x": 1},
            rank=0,
            keep=2,
        )
    (tmp_path / ".tmp-step-000009").mkdir()  # an interrupted save is never a checkpoint
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000005"]
    expected = _train(model, opt, sched, 4)

    model2, opt2, sched2 = _training_objects(1)  # different init: everything must come back
    state, meta = load_checkpoint(
        latest_checkpoint(tmp_path),
        model=model2,
        optimizer=opt2,
        scheduler=sched2,
        rank=0,
        device=torch.device("cpu"),
    )
    assert (state.step, state.step_in_epoch, meta["config"]) == (5, 5, {"x": 1})
    assert _train(model2, opt2, sched2, 4) == expected


class Killed(BaseException):
    """The process killed (not an Exception: nothing may catch it)."""


def test_a_prune_killed_mid_delete_leaves_no_half_deleted_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pruning renames the old folder aside before deleting it: a kill mid-delete leaves a
    temporary folder, which the next run removes, never a step-* folder missing files."""
    model, opt, sched = _training_objects(0)
    objects = dict(model=model, optimizer=opt, scheduler=sched, config={}, rank=0, keep=2)
    for step in (1, 2):
        save_checkpoint(tmp_path, TrainState(step, 0, step), **objects)
    rmtree = shutil.rmtree

    def killed_mid_delete(path: Path, ignore_errors: bool = False) -> None:
        if ignore_errors:  # the save's own cleanups of folders that may not exist
            return rmtree(path, ignore_errors=True)
        (Path(path) / "model.pt").unlink()
        raise Killed

    with monkeypatch.context() as patch, pytest.raises(Killed):
        patch.setattr(shutil, "rmtree", killed_mid_delete)
        save_checkpoint(tmp_path, TrainState(3, 0, 3), **objects)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    assert [p.name for p in tmp_path.glob(".tmp-*")] == [".tmp-pruned-step-000001"]
    remove_leftovers(tmp_path, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]


def test_leftovers_are_removed_and_a_step_moved_aside_is_put_back(tmp_path: Path) -> None:
    """A kill between replace_folder's renames leaves step N only as `.tmp-old-step-N` (beside
    the new copy, maybe half-written): remove_leftovers renames it back. Every other temporary
    checkpoint folder goes; a complete step-* folder and other files stay."""
    model, opt, sched = _training_objects(0)
    objects = dict(model=model, optimizer=opt, scheduler=sched, config={}, rank=0, keep=5)
    for step in (2, 3):
        save_checkpoint(tmp_path, TrainState(step, 0, step), **objects)
    (tmp_path / "step-000003").rename(tmp_path / ".tmp-old-step-000003")
    (tmp_path / ".tmp-step-000003").mkdir()  # the new copy of step 3, half-written
    (tmp_path / ".tmp-old-step-000002").mkdir()  # beside a whole step-000002
    (tmp_path / ".tmp-export").mkdir()  # not a checkpoint's
    remove_leftovers(tmp_path, rank=0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".tmp-export", "step-000002", "step-000003"]
    load = dict(model=model, optimizer=opt, scheduler=sched, rank=0, device=torch.device("cpu"))
    assert load_checkpoint(tmp_path / "step-000003", **load)[0].step == 3


def test_train_state_holds_the_fitted_end_flat_as_before(tmp_path: Path) -> None:
    """meta.json's train_state: TrainState's fields, then the schedule's end fitted to a time
    limit as the flat keys (in the order) TrainState wrote when it mirrored them, and the
    schedule it was fitted under last; a checkpoint so written loads back to both, one from
    before fitting existed to none, and one from before fit_schedule to its old meaning (a
    progress: cosine; none: wsd)."""
    model, opt, sched = _training_objects(0)
    objects = dict(model=model, optimizer=opt, scheduler=sched, config={}, rank=0, keep=2)
    fitted = FittedEnd(end=44, decay_from=31, progress=(30 - 1 - 3) / 57, schedule="cosine")
    save_checkpoint(tmp_path, TrainState(40, 1, 7, tokens_seen=9), fitted=fitted, **objects)
    save_checkpoint(tmp_path, TrainState(41, 1, 8), **objects)
    older, newer = list_checkpoints(tmp_path)
    written = read_meta(older)["train_state"]
    assert list(written.items()) == [
        ("step", 40), ("epoch", 1), ("step_in_epoch", 7), ("tokens_seen", 9), ("stream", False),
        ("streamed_sequences", 0), ("fit_end", 44), ("fit_decay_from", 31),
        ("fit_progress", (30 - 1 - 3) / 57), ("fit_schedule", "cosine"),
    ]  # fmt: skip
    fields = ("fit_end", "fit_decay_from", "fit_progress", "fit_schedule")
    assert [read_meta(newer)["train_state"][key] for key in fields] == [None] * 4
    load = dict(model=model, optimizer=opt, scheduler=sched, rank=0, device=torch.device("cpu"))
    state, meta = load_checkpoint(older, **load)
    assert state == TrainState(40, 1, 7, tokens_seen=9)
    assert fitted_end(meta["train_state"]) == fitted
    assert fitted_end(read_meta(newer)["train_state"]) is None
    wsd = {**written, "fit_decay_from": 36, "fit_progress": None, "fit_schedule": "wsd"}
    assert fitted_end(wsd) == FittedEnd(end=44, decay_from=36, schedule="wsd")
    remapped = {**wsd, "fit_progress": 0.25}  # a wsd decay re-mapped mid-way: still wsd
    assert fitted_end(remapped) == FittedEnd(44, 36, 0.25, schedule="wsd")
    # written before fit_schedule: only cosine fits carried a progress
    old_wsd = {k: v for k, v in wsd.items() if k != "fit_schedule"}
    assert fitted_end(old_wsd) == FittedEnd(end=44, decay_from=36, schedule="wsd")
    meta = read_meta(older)
    meta["train_state"] = {k: v for k, v in written.items() if k != "fit_schedule"}
    (older / "meta.json").write_text(json.dumps(meta))
    state, meta = load_checkpoint(older, **load)
    assert state == TrainState(40, 1, 7, tokens_seen=9)
    assert fitted_end(meta["train_state"]) == fitted
    meta = read_meta(older)
    meta["train_state"] = {key: v for key, v in written.items() if key not in fields}
    (older / "meta.json").write_text(json.dumps(meta))  # before fitting existed
    state, meta = load_checkpoint(older, **load)
    assert state == TrainState(40, 1, 7, tokens_seen=9)
    assert fitted_end(meta["train_state"]) is None


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    lrs = [lr_factor(s, 100, 0.1, 0.1) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0  # 10 warmup steps, linear
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert math.isclose(lr_factor(100, 100, 0.1, 0.1), 0.1)
    assert math.isclose(lrs[55], 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))


def test_wsd_schedule_holds_the_peak_then_decays_as_one_minus_sqrt() -> None:
    # 100 steps: 10 of warmup, 90 after it, the last 30 (decay_ratio 1/3) decaying
    lrs = [lr_factor(s, 100, 0.1, 0.05, "wsd", 1 / 3) for s in range(100)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0  # the same linear warmup as cosine
    assert lrs[10:70] == [1.0] * 60  # stable until the last 30 steps
    assert all(a > b for a, b in zip(lrs[69:], lrs[70:], strict=False))
    assert math.isclose(lrs[99], 0.05)  # the floor at the last step
    assert math.isclose(lrs[84], 0.05 + 0.95 * (1 - math.sqrt(15 / 30)))


def test_export_round_trip(tmp_path: Path) -> None:
    target = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "num_hidden_layers": 6,
    }
    shape = drafter_shape(DrafterConfig(num_layers=2, block_size=4), target, 3, 50, 7)
    torch.manual_seed(0)
    model = DFlashDrafter(shape)
    for p in model.parameters():  # norms start at 1: perturb so a swapped tensor shows
        p.data += 0.01 * torch.randn_like(p)
    folder = export_drafter(model, shape, [1, 2, 3], target, tmp_path / "export", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert config["dflash_config"]["mask_token_id"] == 7
    assert config["num_target_layers"] == 6 and config["torch_dtype"] == "float32"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected_keys(2)

    reloaded = load_export(folder)
    S, A, B = 24, 3, 4
    features_TKD = torch.randn(S, 3, 32)
    document_ids_S = torch.tensor([0] * 10 + [1] * 14)
    anchors_A = torch.tensor([4, 12, 18])
    inputs_QD = torch.randn(A * B, 32)
    positions_T = torch.cat([torch.arange(10), torch.arange(14)])
    block_pos_Q = (positions_T[anchors_A][:, None] + torch.arange(B)).flatten()
    attention = BlockAttention(anchors_A, document_ids_S, B, backend="sdpa")
    args = (features_TKD, inputs_QD, positions_T, block_pos_Q, attention)
    assert torch.equal(model(*args), reloaded(*args))
