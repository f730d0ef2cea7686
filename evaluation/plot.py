"""The plot of `dflash evaluate`: acceptance by draft position, one line per method.

Left: for each draft position k, the fraction of verification forwards that accepted at least
k drafted tokens (the curve starts at the first token's acceptance and falls; its sum + 1 is
the mean of accepted + 1 over all forwards pooled, each reply's last forward counted whole: tau
leaves out what that forward accepted past the budget or the end of sequence, so on pystd's 12
dev prompts this sum + 1 is ~0.1 above the pooled tau, e.g. 5.03 vs 4.92, and neither is the
reported tau, a mean over prompts). Right: the histogram of accepted tokens per forward, as
fractions. Drawn on a bare matplotlib Figure (no pyplot: no display needed, no global backend
switched).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

LABELS = {"prompt_lookup": "prompt lookup", "dflash": "DFlash"}


def plot_acceptance(results: dict[str, Any], path: str | Path) -> Path:
    """Write the PNG of every method in `results` (`dflash evaluate`'s figures) to `path`."""
    methods = [m for m in LABELS if m in results]
    fig = Figure(figsize=(11, 4.2))
    by_position, histogram = fig.subplots(1, 2)
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        figures = results[method]
        label = f"{LABELS[method]} (tau {figures['tau']:.2f})"
        curve = figures["acceptance_by_position"]
        by_position.plot(range(1, len(curve) + 1), curve, marker="o", label=label)
        counts = figures["accepted_histogram"]
        total = max(sum(counts), 1)
        shifted = [a + (i - (len(methods) - 1) / 2) * width for a in range(len(counts))]
        histogram.bar(shifted, [c / total for c in counts], width=width, label=label)
    by_position.set(
        xlabel="draft position k",
        ylabel="forwards with >= k drafted tokens accepted",
        ylim=(0, 1.02),
        title="Acceptance by draft position",
    )
    histogram.set(
        xlabel="drafted tokens accepted per forward",
        ylabel="fraction of forwards",
        title="Accepted tokens per forward",
    )
    for axes in (by_position, histogram):
        axes.grid(alpha=0.3)
        axes.legend()
    verification = verification_title(results.get("sampling", {}))
    fig.suptitle(
        f"{verification} verification, {results['num_prompts']} prompts x "
        f"{results['new_tokens']} new tokens"
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def verification_title(sampling: dict) -> str:
    """How the target picked its tokens, for the plot's title: greedy, or the sampling settings
    that cut its distribution (files written before sampling existed hold none: greedy)."""
    parts = []
    if sampling.get("temperature"):
        parts.append(f"sampled at temperature {sampling['temperature']}")
        if sampling.get("top_p", 1) != 1:
            parts.append(f"top-p {sampling['top_p']}")
        if sampling.get("top_k"):
            parts.append(f"top-k {sampling['top_k']}")
    else:
        parts.append("greedy")
    if sampling.get("repetition_penalty", 1) != 1:
        parts.append(f"repetition penalty {sampling['repetition_penalty']}")
    return ", ".join(parts)
