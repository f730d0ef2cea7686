"""Experiment trackers of `run.report_to`: TensorBoard and W&B, beside RUN/metrics.jsonl.

    dflash train ... --set 'run.report_to=[tensorboard, wandb]'
    tensorboard --logdir RUN/tensorboard        # or: wandb sync RUN/wandb/offline-run-*

`Trackers` is the one interface the loop sees: `log(record)` with the same record that goes
into metrics.jsonl (every step, with its evaluation when it has one), `close()` at the end.
Only rank 0 builds one. Each record becomes flat scalars: `train/loss`, `train/acc/slot_03`,
`eval/tau`, `eval/accept_ge/k_02` (held-out P(>= k drafted tokens accepted)), ... W&B runs
offline unless `WANDB_MODE` says otherwise, so a machine without a network trains as well.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path
from typing import Any

from stage2_train.metrics import acceptance_by_position

INSTALL = "pip install 'dflash-offline[track]' (or: pip install {package})"
# Record fields that are bookkeeping, not curves.
_SKIPPED = {"step", "seqs"}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_trackers(names: list[str]) -> None:
    """Raise one ValueError naming the pip install for every tracker whose package is missing."""
    missing = [name for name in names if not _installed(name)]
    if missing:
        raise ValueError(
            f"run.report_to lists {', '.join(missing)}, which is not installed: "
            + INSTALL.format(package=" ".join(missing))
            + ", or drop it from run.report_to"
        )


def flat_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as `group/name` scalars; per-slot lists become one scalar per
    slot (slot 1 is the first drafted token), so every tracker can plot them."""
    scalars: dict[str, float] = {}
    for key, value in record.items():
        if key in _SKIPPED or isinstance(value, bool):
            continue
        group, name = ("eval", key[5:]) if key.startswith("eval_") else ("train", key)
        if key.startswith("dev_"):  # data.dev_store's figures come with the evaluations
            group = "eval"
        if isinstance(value, (int, float)):
            scalars[f"{group}/{name}"] = float(value)
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            for slot, v in enumerate(value, start=1):
                scalars[f"{group}/{name}/slot_{slot:02d}"] = float(v)
    if "eval_acc_cond" in record:
        for k, p in enumerate(acceptance_by_position(record["eval_acc_cond"]), start=1):
            scalars[f"eval/accept_ge/k_{k:02d}"] = p
    return scalars


class _TensorBoard:
    def __init__(self, out: Path, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run writes a new event file here; purge_step hides the steps past the
        # checkpoint that the killed run had logged, as metrics.jsonl is cut back to it. From
        # step 1 when none was saved: a run killed before its first checkpoint logged steps
        # that the rerun logs again (TensorBoard showed both)
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=resumed_step + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, project: str, name: str | None, config: dict[str, Any]) -> None:
        import wandb

        # One W&B run id per run folder, so a resumed run syncs into the same run.
        id_file = out / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))
        self.run = wandb.init(
            project=project,
            name=name or out.resolve().name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(out),  # wandb writes its files to DIR/wandb
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every tracker of `run.report_to` behind `log(record)` and `close()` (rank 0 only)."""

    def __init__(
        self,
        names: list[str],
        out: Path,
        *,
        project: str,
        name: str | None,
        config: dict[str, Any],
        resumed_step: int = 0,
    ) -> None:
        check_trackers(names)
        self.backends: list[_TensorBoard | _Wandb] = []
        if "tensorboard" in names:
            self.backends.append(_TensorBoard(out, resumed_step))
        if "wandb" in names:
            self.backends.append(_Wandb(out, project, name, config))

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics.jsonl record (a step, with its evaluation when it has one)."""
        if self.backends:
            scalars = flat_scalars(record)
            for backend in self.backends:
                backend.log(scalars, record["step"])

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
