"""Plots of the claims against model size (``study.size_trends``; matplotlib optional: none without it).

    size_trend_<axis>.png   one panel per claim (and LNS-family scheme): every seed's size statistic g
                            against the axis (log scale), the seed mean with the seeds' range, the
                            least-squares line with its 95 % confidence band, and g = 0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from lnstrain.analysis.plots import pyplot
from lnstrain.study.size_trends import SizePoint, Trend, t_quantile_975

AXIS_LABELS = {"depth": "layers", "width": "width"}


def _band(trend: Trend, xs: list[float]) -> tuple[list[float], list[float], list[float]] | None:
    """The fitted line at ``xs`` (log2 axis values) and its 95 % confidence band for the mean."""
    if trend.slope is None:
        return None
    points = [(math.log2(p.axis_value), v) for p in trend.points for v in p.values]
    x_mean = sum(x for x, _ in points) / len(points)
    sxx = sum((x - x_mean) ** 2 for x, _ in points)
    residual = sum((y - trend.centre - trend.slope * (x - x_mean)) ** 2 for x, y in points)
    scale = math.sqrt(residual / (len(points) - 2))
    t = t_quantile_975(len(points) - 2)
    line = [trend.centre + trend.slope * (x - x_mean) for x in xs]
    half = [t * scale * math.sqrt(1 / len(points) + (x - x_mean) ** 2 / sxx) for x in xs]
    return line, [y - h for y, h in zip(line, half)], [y + h for y, h in zip(line, half)]


def plot_size_trends(trends: Sequence[Trend], axis: str, path: Path,
                     beside: Mapping[tuple[str, str, str], Sequence[SizePoint]] | None = None) -> Path | None:
    """``beside``: (variant, claim, scheme) -> other studies' points, drawn apart and reached by the
    fitted line extended (dashed) as an extrapolation."""
    plt = pyplot()
    if plt is None or not trends:
        return None
    columns = min(3, len(trends))
    rows = math.ceil(len(trends) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False)
    for panel, trend in zip(axes.flat, trends):
        for point in trend.points:
            panel.scatter([point.axis_value] * len(point.values), point.values, s=12, color="0.55", zorder=2)
            panel.errorbar([point.axis_value], [point.mean], yerr=[[point.mean - min(point.values)],
                                                                   [max(point.values) - point.mean]],
                           fmt="o", color="C0", capsize=3, zorder=3)
        values = sorted({p.axis_value for p in trend.points})
        xs = [math.log2(values[0]) + (math.log2(values[-1]) - math.log2(values[0])) * i / 40 for i in range(41)]
        band = _band(trend, xs)
        if band is not None:
            line, low, high = band
            panel.plot([2 ** x for x in xs], line, color="C1", label=f"{trend.verdict}")
            panel.fill_between([2 ** x for x in xs], low, high, color="C1", alpha=0.2)
        outside = list((beside or {}).get((trend.variant, trend.claim, trend.scheme), []))
        for point in outside:
            panel.scatter([point.axis_value] * len(point.values), point.values, marker="D", color="C3", zorder=3,
                          label=f"{point.size} (not fitted)")
        if outside and band is not None:
            far = math.log2(max(p.axis_value for p in outside))
            extended = [xs[-1] + (far - xs[-1]) * i / 20 for i in range(21)]
            slope_line = _band(trend, extended)
            if slope_line is not None:
                panel.plot([2 ** x for x in extended], slope_line[0], color="C1", linestyle="--", linewidth=0.9)
        values = sorted(set(values) | {p.axis_value for p in outside})
        if band is not None or outside:
            panel.legend(fontsize=7)
        panel.axhline(0.0, color="k", linewidth=0.8)
        panel.set_xscale("log", base=2)
        panel.set_xticks(values, [str(v) for v in values])
        panel.set_xlabel(AXIS_LABELS[axis])
        panel.set_title(f"{trend.claim}" + (f" [{trend.scheme}]" if trend.scheme not in ("lns", "pre_ln") else ""),
                        fontsize=8)
        panel.set_ylabel(f"{trend.label} ({'> 0' if trend.paper_sign > 0 else '< 0'}: paper)", fontsize=7)
        panel.grid(True, alpha=0.3)
    for panel in list(axes.flat)[len(trends):]:
        panel.set_visible(False)
    figure.suptitle(f"The paper's claims against {axis} (each run at its last step)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
