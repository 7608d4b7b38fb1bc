"""Plots of a study's depth analyses against training length (matplotlib optional: none without it).

    delta_p_by_tokens_<size>_<variant>.png    ΔP(l) by layer, one panel per scheme, one line per length
    norm_gains_by_tokens_<size>_<variant>.png the MLP norm's effective gain by layer, likewise
    deep_half_by_tokens_<size>.png            mean ΔP of the deepest half against tokens, per scheme and variant
Seeds are averaged; the deep-half plot draws their range as error bars.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Protocol

from lnstrain.analysis.claims import deep_half_mean_delta_loss
from lnstrain.analysis.plots import pyplot, file_stem

if TYPE_CHECKING:
    from lnstrain.analysis.depth_analysis import DepthAnalysis
    from lnstrain.study.plan import PlannedRun


class CheckpointAnalysis(Protocol):
    """One run's depth analysis at one checkpoint (``lnstrain.study.depth.CheckpointAnalysis``)."""

    run: PlannedRun
    step: int
    tokens: int
    analysis: DepthAnalysis

logger = logging.getLogger(__name__)


def _mean_profile(members: Sequence[CheckpointAnalysis], per_layer) -> list[float]:
    profiles = [per_layer(m.analysis) for m in members]
    return [fmean(values) for values in zip(*profiles)]


def _series_label(size: str, variant: str) -> str:
    return f"{size}_{variant}" if variant else size


def plot_depth_by_tokens(analyses: Sequence[CheckpointAnalysis], reference: str, out_dir: Path) -> list[Path]:
    plt = pyplot()
    if plt is None or not analyses:
        return []
    # (size, variant) -> scheme -> step -> members (seeds)
    grouped: dict[tuple[str, str], dict[str, dict[int, list]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for a in analyses:
        grouped[(a.run.run.size, a.run.run.variant)][a.run.run.scheme][a.step].append(a)
    paths = []
    profiles = {
        "delta_p": ("ΔP(l) (nats)", lambda run: [p.delta_loss for p in run.pruning], "symlog"),
        "norm_gains": ("MLP norm's effective gain (mean |γ| × factor)",
                       lambda run: [gains[1] for gains in run.norm_gains], "log"),
    }
    for (size, variant), by_scheme in grouped.items():
        schemes = sorted(by_scheme, key=lambda s: (s != reference, s))
        steps = sorted({step for by_step in by_scheme.values() for step in by_step})
        colours = plt.get_cmap("viridis")
        for key, (ylabel, per_layer, scale) in profiles.items():
            if key == "norm_gains" and not all(m.analysis.norm_gains for s in by_scheme.values()
                                               for ms in s.values() for m in ms):
                continue
            figure, axes = plt.subplots(1, len(schemes), figsize=(4.2 * len(schemes), 3.6), sharey=True, squeeze=False)
            for axis, scheme in zip(axes[0], schemes):
                for index, step in enumerate(steps):
                    members = by_scheme[scheme].get(step)
                    if not members:
                        continue
                    values = _mean_profile(members, per_layer)
                    axis.plot(range(1, len(values) + 1), values, marker=".", color=colours(index / max(len(steps) - 1, 1)),
                              label=f"{members[0].tokens / 1e6:.2f}M tokens")
                axis.set(title=scheme, xlabel="layer", yscale=scale)
                if scale == "symlog":
                    axis.set_yscale("symlog", linthresh=1e-3)
                axis.grid(True, alpha=0.3)
            axes[0][0].set_ylabel(ylabel)
            axes[0][-1].legend(fontsize=7)
            figure.suptitle(f"{_series_label(size, variant)}: {ylabel.split(' (')[0]} against training tokens")
            paths.append(_save(plt, figure, out_dir / f"{key}_by_tokens_{file_stem(_series_label(size, variant))}.png"))
    for size in dict.fromkeys(size for size, _ in grouped):
        figure, axis = plt.subplots(figsize=(6.5, 4))
        for (series_size, variant), by_scheme in grouped.items():
            if series_size != size:
                continue
            for scheme in sorted(by_scheme, key=lambda s: (s != reference, s)):
                points = []
                for step, members in sorted(by_scheme[scheme].items()):
                    values = [deep_half_mean_delta_loss(m.analysis) for m in members]
                    points.append((members[0].tokens, fmean(values), min(values), max(values)))
                tokens = [p[0] for p in points]
                means = [p[1] for p in points]
                errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
                axis.errorbar(tokens, means, yerr=errors, marker="o", capsize=3,
                              label=f"{scheme} {variant}".strip())
        axis.set(xscale="log", xlabel="training tokens", ylabel="mean ΔP of the deepest half (nats)",
                 title=f"{size}: how much the deep layers matter")
        axis.set_yscale("symlog", linthresh=1e-3)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
        paths.append(_save(plt, figure, out_dir / f"deep_half_by_tokens_{file_stem(size)}.png"))
    return paths


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
