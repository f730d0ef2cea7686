"""PNG plots of a training run, drawn from RUN/metrics.jsonl into RUN/plots/.

    dflash plot RUN        # redraw them (training draws them at each evaluation)

- `loss.png`: training loss per step (and its moving average) and held-out loss per evaluation;
- `slot_accuracy.png`: held-out accuracy of each draft slot k = 1..B-1 (`eval_acc`), one line
  per evaluation (at most eight, evenly spread, always the newest);
- `acceptance.png`: left, held-out P(>= k drafted tokens accepted) by draft position k (from
  `eval_acc_cond`; its sum + 1 is tau), with the newest evaluation's curve under independent
  slot errors dashed; right, tau and its independent-slot estimate over steps (and
  `dev_chained_tau` when `data.dev_store` is set).

Drawn on bare matplotlib Figures (no pyplot: no display, no global backend switched) and
written through a temporary file, so a reader never sees half a PNG. Training calls
`draw_plots_safely`: a plotting failure is a warning, never the end of a run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from common.logging import get_logger
from stage2_train.metrics import acceptance_by_position, read_records

log = get_logger()
MAX_CURVES = 8  # evaluations drawn per per-slot figure; more would be an unreadable legend


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The records of RUN/metrics.jsonl; ValueError when the run has none."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: is {run} a `dflash train` run folder (--out)?")
    return read_records(path)


def plot_run(run: str | Path) -> list[Path]:
    """Draw every plot of the run's metrics.jsonl into RUN/plots/; returns the files written
    (the per-slot figures only once there is an evaluation)."""
    records = read_metrics(run)
    if not records:
        raise ValueError(f"{Path(run) / 'metrics.jsonl'} is empty: no step has finished yet")
    folder = Path(run) / "plots"
    if folder.exists() and not folder.is_dir():  # mkdir's bare 'File exists' named no fix
        raise ValueError(
            f"{folder} is a file, not a folder: the plots are drawn into {folder}/; move or "
            "remove that file, then rerun"
        )
    folder.mkdir(parents=True, exist_ok=True)
    evals = [r for r in records if "eval_acc" in r]
    written = [_save(_loss_figure(records, evals), folder / "loss.png")]
    if evals:
        shown = _spread(evals)
        written.append(_save(_slot_figure(shown), folder / "slot_accuracy.png"))
        written.append(_save(_acceptance_figure(shown, evals, records), folder / "acceptance.png"))
    return written


def draw_plots_safely(run: str | Path) -> None:
    """`plot_run` for the training loop: any failure is logged as a warning, not raised."""
    try:
        plot_run(run)
    except Exception as err:  # a plot is never worth a training run
        log.warning("could not draw the plots of %s (training goes on): %r", run, err)


def _spread(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most MAX_CURVES evaluations, evenly spread from the first to the newest."""
    if len(evals) <= MAX_CURVES:
        return evals
    last = len(evals) - 1
    picks = sorted({round(i * last / (MAX_CURVES - 1)) for i in range(MAX_CURVES)})
    return [evals[i] for i in picks]


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.85 * i / max(n - 1, 1)) for i in range(n)]


def _loss_figure(records: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    window = max(1, len(records) // 50)
    ax.plot(steps, losses, alpha=0.35 if window > 1 else 1.0, linewidth=0.8, label="train")
    if window > 1:  # the raw curve is noisy at one batch per step
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(losses))
        ]
        ax.plot(steps, smooth, label=f"train ({window}-step mean)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
    if all(v > 0 for v in losses):  # loss falls by orders of magnitude: log, plain labels
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis_format(FuncFormatter(lambda y, _pos: f"{y:g}"))
    ax.set(xlabel="step", ylabel="loss (slot-weighted CE)", title="Loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return fig


def _slot_figure(shown: list[dict[str, Any]]) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for record, color in zip(shown, _colors(len(shown)), strict=True):
        acc = record["eval_acc"]
        ax.plot(range(1, len(acc) + 1), acc, "o-", color=color, label=f"step {record['step']}")
    ax.set(
        xlabel="draft slot k (1 = first drafted token)",
        ylabel="held-out accuracy vs target argmax",
        ylim=(0, 1.02),
        title="Per-slot accuracy",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _acceptance_figure(
    shown: list[dict[str, Any]], evals: list[dict[str, Any]], records: list[dict[str, Any]]
) -> Any:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4.2))
    by_position, over_steps = fig.subplots(1, 2)
    for record, color in zip(shown, _colors(len(shown)), strict=True):
        curve = acceptance_by_position(record["eval_acc_cond"])
        label = f"step {record['step']} (tau {record['eval_tau']:.2f})"
        by_position.plot(range(1, len(curve) + 1), curve, "o-", color=color, label=label)
    newest = shown[-1]
    independent = acceptance_by_position(newest["eval_acc"])  # product of marginal accuracies
    by_position.plot(
        range(1, len(independent) + 1),
        independent,
        "--",
        color="grey",
        label=f"step {newest['step']}, slots independent",
    )
    by_position.set(
        xlabel="draft position k",
        ylabel="blocks with >= k drafted tokens accepted",
        ylim=(0, 1.02),
        title="Held-out acceptance by draft position",
    )
    by_position.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = [r["step"] for r in evals]
    over_steps.plot(steps, [r["eval_tau"] for r in evals], "o-", label="tau")
    over_steps.plot(
        steps, [r["eval_tau_marginal"] for r in evals], "--", label="tau, slots independent"
    )
    dev = [r for r in records if "dev_chained_tau" in r]
    if dev:  # data.dev_store: the online tau computed from a store of the target's continuations
        over_steps.plot(
            [r["step"] for r in dev],
            [r["dev_chained_tau"] for r in dev],
            "s-",
            label="dev chained tau",
        )
    over_steps.set(xlabel="step", ylabel="accepted tokens per block + 1", title="Held-out tau")
    for ax in (by_position, over_steps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    os.replace(tmp, path)
    return path
