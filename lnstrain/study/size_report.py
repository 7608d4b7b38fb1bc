"""The size section of a depth study's report (``depth.size_axes``; docs/depth_width_study.md): the
claims' verdicts and size statistics along each axis, their fitted trends and zero crossings, the
second-seed rule, and which runs ran. ``study.depth.collect_depth`` calls it.

Files beside ``report.md``:

    size_trends.csv        one row per (variant, axis, claim, scheme, size, seed): the size statistic g
    size_trend_fits.csv    one row per (variant, axis, claim, scheme): slope, its interval, verdict, crossing
    size_trend_<axis>.png  g against the axis, per claim (``size_trend_plots``; matplotlib optional)
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lnstrain.analysis.claims import ClaimResult, turning_step, verdict_mark
from lnstrain.study.size_trends import SizePoint, Trend, final_analyses, second_seed_calls, size_points, size_trends

if TYPE_CHECKING:
    from lnstrain.study.depth_plots import CheckpointAnalysis
    from lnstrain.study.plan import PlannedRun
    from lnstrain.study.spec import Study


class Comparison(Protocol):
    """The claims of one size and variant at one step (``lnstrain.study.depth.Comparison``)."""

    size: str
    variant: str
    step: int
    claims: list[ClaimResult]

AXIS_UNITS = {"depth": "layers", "width": "width"}
POINT_COLUMNS = ["variant", "axis", "claim", "scheme", "size", "axis_value", "non_embedding_parameters", "seed",
                 "size_statistic", "raw_difference"]
FIT_COLUMNS = ["variant", "axis", "claim", "scheme", "size_statistic", "points", "slope_per_doubling", "slope_low",
               "slope_high", "centre", "trend", "zero_at", "zero_at_parameters", "zero_low", "zero_high",
               "zero_inside_range", "zero_beyond_largest"]


def _number(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _cell(values: Sequence[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:+.3f}" if len(values) == 1 else f"{mean:+.3f} (" + ", ".join(f"{v:+.3f}" for v in values) + ")"


def _parameters(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}K"


def _axis_sizes(study: Study, planned: Sequence[PlannedRun], axis: str) -> list[tuple[str, int]]:
    """The axis's sizes with their axis values, in increasing order."""
    from lnstrain.study.spec import SIZE_AXES

    values = {p.run.size: getattr(p.config.model, SIZE_AXES[axis]) for p in planned}
    return sorted(((size, values[size]) for size in study.spec.depth.size_axes[axis] if size in values),
                  key=lambda item: item[1])


def _final_claims(comparisons: Sequence[Comparison], planned: Sequence[PlannedRun]
                  ) -> dict[tuple[str, str], list[ClaimResult]]:
    """(size, variant) -> the claims compared at the runs' last step."""
    last = {(p.run.size, p.run.variant): p.config.total_steps for p in planned}
    return {(c.size, c.variant): c.claims for c in comparisons if last.get((c.size, c.variant)) == c.step}


def verdicts_along(axis: str, sizes: list[tuple[str, int]], variant: str,
                   claims: dict[tuple[str, str], list[ClaimResult]]) -> list[str]:
    """Each claim's verdict at each size of the axis, and the size from which it holds."""
    unit = AXIS_UNITS[axis]
    lines = ["| claim | scheme | " + " | ".join(f"{size} ({value})" for size, value in sizes) + f" | holds from ({unit}) |",
             "|---|---|" + "---|" * (len(sizes) + 1)]
    keys = list(dict.fromkeys((r.id, r.scheme) for size, _ in sizes for r in claims.get((size, variant), [])))
    for claim_id, scheme in keys:
        cells, verdicts = [], []
        for size, value in sizes:
            result = next((r for r in claims.get((size, variant), []) if (r.id, r.scheme) == (claim_id, scheme)), None)
            cells.append("–" if result is None else verdict_mark(result))
            verdicts.append((value, None if result is None else result.holds))
        turn = turning_step(verdicts)
        held = "–" if all(h is None for _, h in verdicts) else ("never" if turn is None else str(turn))
        lines.append(f"| `{claim_id}` | {scheme} | " + " | ".join(cells) + f" | {held} |")
    return lines + [""]


def trend_table(axis: str, sizes: list[tuple[str, int]], trends: Sequence[Trend]) -> list[str]:
    """The size statistic at each size (seed mean, seeds in brackets), the slope and the verdict."""
    lines = ["| claim | scheme | size statistic g (paper's side) | " + " | ".join(str(v) for _, v in sizes)
             + " | slope per doubling (95 %) | trend | g = 0 at |", "|---|---|---|" + "---|" * (len(sizes) + 3)]
    for t in trends:
        by_size = {p.size: p for p in t.points}
        cells = [_cell(by_size[size].values) if size in by_size else "–" for size, _ in sizes]
        slope = "–" if t.slope is None else (f"{t.slope:+.3f} ({t.slope_low:+.3f} to {t.slope_high:+.3f})")
        zero = "–" if t.crossing is None else f"{t.crossing.axis_value:.3g} {AXIS_UNITS[axis]}"
        lines.append(f"| `{t.claim}` | {t.scheme} | {t.label} ({'> 0' if t.paper_sign > 0 else '< 0'}) | "
                     + " | ".join(cells) + f" | {slope} | {t.verdict} | {zero} |")
    return lines + [""]


def fitted_at(trend: Trend, axis_value: float) -> float | None:
    """The trend's fitted line at ``axis_value`` (an extrapolation beyond its sizes)."""
    if trend.slope is None or trend.centre is None:
        return None
    x_mean = statistics.fmean(math.log2(p.axis_value) for p in trend.points for _ in p.values)
    return trend.centre + trend.slope * (math.log2(axis_value) - x_mean)


def beside_points(axis: str, analyses: Sequence[CheckpointAnalysis], reference: str
                  ) -> dict[tuple[str, str, str], list[SizePoint]]:
    """(variant, claim, scheme) -> the points of another study's runs on this axis."""
    sizes = sorted({a.run.run.size for a in analyses})
    return size_points(analyses, axis, sizes, reference)


def beside_table(axis: str, trends: Sequence[Trend], points: dict[tuple[str, str, str], list[SizePoint]],
                 analyses: Sequence[CheckpointAnalysis]) -> list[str]:
    """Each outside point's g beside the value this axis's fitted line extrapolates to there."""
    shown = sorted({(p.size, p.axis_value, p.parameters) for series in points.values() for p in series},
                   key=lambda item: item[1])
    if not shown:
        return []
    unit = AXIS_UNITS[axis]
    tokens = {a.run.run.size: a.tokens for a in final_analyses(analyses)}
    lines = ["Beside this trend, not fitted (another study's runs at their last step; each trained its own way): "
             + "; ".join(f"{size} ({value} {unit}, {_parameters(n)} non-embedding parameters, "
                         f"{tokens.get(size, 0) / n:.3g} tokens per parameter)" for size, value, n in shown)
             + ". \"line\": this axis's fitted line extrapolated to that size.", "",
             "| claim | scheme | " + " | ".join(f"{size} g | line at {value} {unit}" for size, value, _ in shown) + " |",
             "|---|---|" + "---|---|" * len(shown)]
    for t in trends:
        by_size = {p.size: p for p in points.get((t.variant, t.claim, t.scheme), [])}
        cells = []
        for size, value, _ in shown:
            line = fitted_at(t, value)
            cells += [_cell(by_size[size].values) if size in by_size else "–", "–" if line is None else f"{line:+.3f}"]
        lines.append(f"| `{t.claim}` | {t.scheme} | " + " | ".join(cells) + " |")
    return lines + [""]


def crossing_notes(axis: str, trends: Sequence[Trend]) -> list[str]:
    """For each trend with a zero crossing: where, its range, and the caveat of extrapolating."""
    unit = AXIS_UNITS[axis]
    other_axis = {"depth": "the width", "width": "the depth"}[axis]
    lines = []
    for t in trends:
        c = t.crossing
        if c is None:
            continue
        measured = sorted({p.axis_value for p in t.points})
        span = "unbounded (the slope's interval contains 0)" if c.low is None else (
            f"{c.low:.3g} to {c.high:.3g} {unit} by the slope's 95 % interval")
        where = (f"inside the measured range ({measured[0]} to {measured[-1]} {unit})" if c.inside else
                 f"{c.beyond:.3g}× the largest size measured ({measured[-1]} {unit})")
        lines.append(f"- `{t.claim}` ({t.scheme}): g = 0 at about {c.axis_value:.3g} {unit} "
                     f"({_parameters(c.parameters)} non-embedding parameters along this axis; {span}), {where}. "
                     + ("" if c.inside else
                        f"An extrapolation of a straight line in log size fitted to {len(measured)} sizes: nothing "
                        "here tests that the trend stays straight beyond them, and the lr rule, the tokens per "
                        f"parameter, the data and {other_axis} are held at this study's values."))
    return lines + ([""] if lines else [])


def second_seed_lines(study: Study, analyses: Sequence[CheckpointAnalysis]) -> list[str]:
    calls = second_seed_calls(analyses, study.spec.sizes, study.spec.depth.reference)
    if not calls:
        return []
    lines = ["**The second-seed rule** (a size with one seed needs the second when a comparative claim's |g| is "
             "no larger than the largest seed-to-seed change of that g at the sizes with two seeds):", ""]
    for call in calls:
        size = f"{call.size} ({call.variant})" if call.variant else call.size
        if call.claims:
            verdict = "second seed called for by " + ", ".join(f"`{c}`" for c in call.claims)
        elif call.unjudged:
            verdict = "not decidable yet: no size has two seeds of " + ", ".join(f"`{c}`" for c in call.unjudged)
        else:
            verdict = "no second seed needed: every comparative claim's |g| exceeds its seed spread"
        lines.append(f"- {size}: {verdict}")
    return lines + [""]


def runs_table(planned: Sequence[PlannedRun], analyses: Sequence[CheckpointAnalysis], archived: Sequence[str]
               ) -> list[str]:
    """Which runs ran to their last step and were analysed, which stopped where, which did not run here."""
    done = {(a.run.run.name, a.step) for a in final_analyses(analyses)}
    lines = ["| run | steps | tokens | status |", "|---|---|---|---|"]
    for p in planned:
        name, total = p.run.name, p.config.total_steps
        if (name, total) in done:
            source = " (read from the archive)" if f"{name} step {total}" in archived else ""
            status = f"finished, analysed at step {total}{source}"
        else:
            steps = [int(d.name.removeprefix("global_step")) for d in p.config.checkpoint_dir.glob("global_step*")
                     if d.name.removeprefix("global_step").isdigit()] if p.config.checkpoint_dir.is_dir() else []
            status = (f"not finished: last checkpoint at step {max(steps)} of {total}" if steps
                      else "not run (no checkpoint here, none archived)")
        lines.append(f"| {name} | {total:,} | {p.tokens:,} | {status} |")
    return lines + [""]


def write_csvs(trends: Sequence[Trend], out_dir: Path) -> dict[str, Path]:
    files = {"size trends": out_dir / "size_trends.csv", "size trend fits": out_dir / "size_trend_fits.csv"}
    with open(files["size trends"], "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=POINT_COLUMNS)
        writer.writeheader()
        for t in trends:
            for p in t.points:
                for seed, value, raw in zip(p.seeds, p.values, p.raw_differences):
                    writer.writerow({"variant": t.variant, "axis": t.axis, "claim": t.claim, "scheme": t.scheme,
                                     "size": p.size, "axis_value": p.axis_value, "non_embedding_parameters": p.parameters,
                                     "seed": seed, "size_statistic": value, "raw_difference": raw})
    with open(files["size trend fits"], "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIT_COLUMNS)
        writer.writeheader()
        for t in trends:
            c = t.crossing
            writer.writerow({"variant": t.variant, "axis": t.axis, "claim": t.claim, "scheme": t.scheme,
                             "size_statistic": t.label, "points": t.n, "slope_per_doubling": t.slope,
                             "slope_low": t.slope_low, "slope_high": t.slope_high, "centre": t.centre,
                             "trend": t.verdict, "zero_at": c.axis_value if c else "",
                             "zero_at_parameters": c.parameters if c else "", "zero_low": c.low if c else "",
                             "zero_high": c.high if c else "", "zero_inside_range": c.inside if c else "",
                             "zero_beyond_largest": c.beyond if c else ""})
    return files


def size_section(study: Study, planned: Sequence[PlannedRun], analyses: Sequence[CheckpointAnalysis],
                 comparisons: Sequence[Comparison], archived: Sequence[str], out_dir: Path,
                 beside: dict[str, list[CheckpointAnalysis]] | None = None) -> tuple[list[str], dict[str, Path]]:
    """The report's lines about size, and the files written beside it; ``beside``: axis -> other studies'
    analyses shown beside that axis's trend (``depth.beside``)."""
    from lnstrain.study.size_trend_plots import plot_size_trends

    depth = study.spec.depth
    trends = size_trends(analyses, depth.size_axes, depth.reference)
    files = write_csvs(trends, out_dir)
    claims = _final_claims(comparisons, planned)
    lines = ["## The claims against model size", "",
             "Each run at its last step (the end of its schedule). g: each claim's size statistic "
             "(docs/depth_width_study.md), one per seed, LNS seed s paired with Pre-LN seed s; a cell is the "
             "seed mean, each seed in brackets when several. Slope: least squares of every per-seed g on log₂ of "
             "the axis, per doubling, with its 95 % t-interval; narrows / widens: the interval excludes 0 and the "
             "gap moves towards / away from zero as the model grows; turns: it excludes 0 and the line crosses zero "
             "inside the measured sizes; holds: the interval contains 0.", ""]
    for variant in dict.fromkeys(p.run.variant for p in planned):
        for axis in depth.size_axes:
            sizes = _axis_sizes(study, planned, axis)
            along = [t for t in trends if t.axis == axis and t.variant == variant]
            title = f"{axis.capitalize()} ({', '.join(size for size, _ in sizes)})"
            outside = (beside or {}).get(axis, [])
            outside_points = beside_points(axis, outside, depth.reference)
            lines += [f"### {title}" + (f", {variant}" if variant else ""), "",
                      *verdicts_along(axis, sizes, variant, claims), *trend_table(axis, sizes, along),
                      *crossing_notes(axis, along), *beside_table(axis, along, outside_points, outside)]
            plot = plot_size_trends(along, axis, out_dir / f"size_trend_{axis}{'_' + variant if variant else ''}.png",
                                    outside_points)
            if plot is not None:
                files[plot.stem] = plot
                lines += [f"![{plot.name}]({plot.name})", ""]
    lines += second_seed_lines(study, analyses)
    lines += ["### Runs", "", *runs_table(planned, analyses, archived)]
    return lines, files
