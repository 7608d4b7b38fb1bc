"""PNG plots of depth analyses; matplotlib is optional (no plots without it)."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lnstrain.analysis.depth_analysis import DepthAnalysis

logger = logging.getLogger(__name__)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (and a warning) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def file_stem(name: str) -> str:
    """A run name made safe for file names."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "run"


def write_plots(runs: Sequence[DepthAnalysis], out_dir: Path) -> list[str]:
    """Write variance.png, pruning.png and angular_<run>.png; return their file names."""
    plt = pyplot()
    if plt is None:
        return []
    names = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        ax.plot(range(1, run.num_layers + 1), run.output_variance[1:], marker="o", label=run.name)
    ax.set(xlabel="layer", ylabel="output variance", yscale="log", title="Residual-stream variance by depth")
    integer_layers(ax.xaxis)
    ax.legend()
    names.append(_save(plt, fig, out_dir, "variance.png"))

    names.append(_save(plt, pruning_figure(plt, runs), out_dir, "pruning.png"))

    import numpy as np

    for run in runs:
        grid = np.array([[np.nan if d is None else d for d in row] for row in run.distance_by_offset()])
        fig, ax = plt.subplots(figsize=(6, 5))
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0.0,
                          extent=(0.5, run.num_layers + 0.5, 0.5, run.num_layers + 0.5))
        fig.colorbar(image, ax=ax, label="angular distance / π")
        ax.set(xlabel="layer l", ylabel="offset n", title=f"{run.name}: d(entering l, entering l + n)")
        integer_layers(ax.xaxis, ax.yaxis)
        names.append(_save(plt, fig, out_dir, f"angular_{file_stem(run.name)}.png"))
    return names


PRUNING_HEADROOM = 2.5
"""The y axis reaches this factor beyond the tallest (and deepest) bar: on the symlog scale the tallest
bar, usually a layer 1, would otherwise end at the frame and look cut off."""


def integer_layers(*axes) -> None:
    """Ticks at whole layer numbers only."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True))


def pruning_figure(plt, runs: Sequence[DepthAnalysis]):
    """ΔP(ℓ) of every run as bars side by side, on a symlog scale (layer 1 would dwarf the rest); bars
    whose removal lowers the loss hatched, the near-identity band |ΔP| < threshold shaded."""
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(runs)
    threshold = runs[0].summary.near_identity_threshold
    handles = [Patch(facecolor="grey", alpha=0.15, label=f"near-identity (|ΔP| < {threshold:g})")]
    for index, run in enumerate(runs):
        layers = [p.layer + (index - (len(runs) - 1) / 2) * width for p in run.pruning]
        bars = ax.bar(layers, [p.delta_loss for p in run.pruning], width=width)
        handles.append(Patch(facecolor=bars.patches[0].get_facecolor(), label=run.name))
        for bar, p in zip(bars, run.pruning):
            if p.delta_loss < 0:
                bar.set_hatch("///")
                bar.set_edgecolor("black")
    if any(p.delta_loss < 0 for run in runs for p in run.pruning):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="removal lowers the loss"))
    ax.axhspan(-threshold, threshold, color="grey", alpha=0.15)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_yscale("symlog", linthresh=threshold)
    losses = [p.delta_loss for run in runs for p in run.pruning]
    ax.set_ylim(PRUNING_HEADROOM * min(min(losses, default=0.0), -threshold / 2),
                PRUNING_HEADROOM * max(max(losses, default=0.0), threshold))
    ax.set(xlabel="layer removed", ylabel="Δ validation loss (nats)", title="Layer pruning: ΔP(l)")
    integer_layers(ax.xaxis)
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # clear of the bars
    return fig


def _save(plt, fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name
