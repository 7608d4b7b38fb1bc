"""The paper's claims against model size (``depth.size_axes``; docs/depth_width_study.md).

Each run is taken at its last step. For every claim (``analysis.claims.CLAIMS``), each seed gives one
*size statistic* g: the claim's statistic in a form comparable across sizes (``SIZE_FORMS``), with
the claim's sign (g lies on the paper's side exactly when the claim holds). Comparative claims pair
seed s of the LNS-family scheme with seed s of the reference (same initial weights and data order).

Along each axis (``depth``: sizes differing in ``num_layers``; ``width``: in ``hidden_size``) the
per-seed g are fitted by ordinary least squares on log2 of the axis value; the slope per doubling
gets a 95 % t-interval and a verdict (``narrows``, ``widens``, ``turns``, ``holds`` or ``too few points``),
and where the fitted line is zero is reported with the slope interval's range (``Crossing``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lnstrain.analysis.claims import CLAIMS, LNS_FAMILY, REFERENCE_SCHEME, Claim
from lnstrain.study.spec import SIZE_AXES

if TYPE_CHECKING:
    from lnstrain.analysis.depth_analysis import DepthAnalysis
    from lnstrain.study.depth_plots import CheckpointAnalysis


@dataclass(frozen=True)
class SizeForm:
    """How a claim's statistic becomes a size statistic: ``value(subject, other, layers)``, where
    ``other`` is the reference scheme's statistic or the claim's constant; None when undefined."""

    label: str
    value: Callable[[float, float, int], float | None]


def _log_ratio(subject: float, other: float, layers: int) -> float | None:
    return math.log(subject / other) if subject > 0 and other > 0 else None


def _difference(subject: float, other: float, layers: int) -> float | None:
    return subject - other


def _relative(subject: float, other: float, layers: int) -> float | None:
    return (subject - other) / abs(other) if other != 0 else None


def _per_layer(subject: float, other: float, layers: int) -> float | None:
    return (subject - other) / layers


SIZE_FORMS: dict[str, SizeForm] = {
    "pre_ln_variance_grows": SizeForm("ln(variance ratio)", _log_ratio),
    "lns_curbs_variance_growth": SizeForm("ln(LNS ratio / Pre-LN ratio)", _log_ratio),
    "lns_lowers_loss": SizeForm("LNS − Pre-LN loss (nats)", _difference),
    "pre_ln_deep_layers_matter_less": SizeForm("deep-half share of ΔP − 0.5", _difference),
    "lns_deep_layers_matter_more": SizeForm("(LNS − Pre-LN) / Pre-LN, deep-half ΔP", _relative),
    "lns_fewer_near_identity_layers": SizeForm("(LNS − Pre-LN) near-identity layers / L", _per_layer),
    "pre_ln_deep_layers_similar": SizeForm("deep / shallow d(l, l+1) − 1", _difference),
    "lns_deep_layers_less_similar": SizeForm("(LNS − Pre-LN) / Pre-LN, deep-half d(l, l+1)", _relative),
}

T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
"""Student's t 0.975 quantiles for 1 … 30 degrees of freedom."""


def t_quantile_975(dof: int) -> float:
    """The two-sided 95 % t quantile; beyond 30 degrees of freedom a Cornish-Fisher expansion (error < 1e-3)."""
    if dof < 1:
        raise ValueError(f"a t-interval needs at least one degree of freedom (got {dof})")
    if dof <= len(T_975):
        return T_975[dof - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


@dataclass
class SizePoint:
    """One size's per-seed size statistics."""

    size: str
    axis_value: int
    parameters: int
    """Non-embedding parameters."""
    seeds: list[int]
    values: list[float]
    raw_differences: list[float]
    """Per seed: the claim's own statistic, subject minus reference (or minus the constant)."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)


@dataclass
class Crossing:
    """Where the fitted line is zero, along the axis and in non-embedding parameters."""

    axis_value: float
    parameters: float
    low: float | None
    high: float | None
    """The axis values the slope interval's ends give (None: unbounded, the interval contains 0)."""
    inside: bool
    """Within the measured range of the axis."""
    beyond: float
    """axis_value / the largest size measured (> 1: an extrapolation)."""


@dataclass
class Trend:
    """One claim (and LNS-family scheme) along one axis."""

    variant: str
    axis: str
    claim: str
    scheme: str
    label: str
    paper_sign: int
    """+1 when the paper expects g > 0, -1 when g < 0."""
    points: list[SizePoint]
    n: int = 0
    slope: float | None = None
    slope_low: float | None = None
    slope_high: float | None = None
    centre: float | None = None
    """The fitted g at the mean log2 axis value (the mean of the per-seed g)."""
    verdict: str = "too few points"
    crossing: Crossing | None = None


def _paper_sign(claim: Claim) -> int:
    return 1 if claim.relation == "greater" else -1


def final_analyses(analyses: Sequence[CheckpointAnalysis]) -> list[CheckpointAnalysis]:
    """Each run's analysis at its last step."""
    return [a for a in analyses if a.step == a.run.config.total_steps]


def _claim_values(claim: Claim, scheme: str, by_seed: dict[tuple[str, int], DepthAnalysis]
                  ) -> tuple[list[int], list[float], list[float]]:
    form = SIZE_FORMS[claim.id]
    seeds, values, raws = [], [], []
    for (run_scheme, seed), subject in sorted(by_seed.items(), key=lambda item: item[0][1]):
        if run_scheme != scheme:
            continue
        if isinstance(claim.against, str):
            other_run = by_seed.get((claim.against, seed))
            if other_run is None:
                continue
            other = claim.measure(other_run)
        else:
            other = float(claim.against)
        value = form.value(claim.measure(subject), other, subject.num_layers)
        if value is not None and math.isfinite(value):
            seeds.append(seed)
            values.append(value)
            raws.append(claim.measure(subject) - other)
    return seeds, values, raws


def size_points(analyses: Sequence[CheckpointAnalysis], axis: str | None, sizes: Sequence[str], reference: str
                ) -> dict[tuple[str, str, str], list[SizePoint]]:
    """(variant, claim, scheme) -> the points along the axis (None: ordered by non-embedding
    parameters), from the runs' last-step analyses."""
    runs: dict[tuple[str, str], dict[tuple[str, int], DepthAnalysis]] = defaultdict(dict)
    parameters, axis_values = {}, {}
    for a in final_analyses(analyses):
        run = a.run.run
        if run.size in sizes:
            runs[(run.variant, run.size)][(run.scheme, run.seed)] = a.analysis
            parameters[run.size] = a.run.non_embedding_parameters
            axis_values[run.size] = (getattr(a.run.config.model, SIZE_AXES[axis]) if axis
                                     else a.run.non_embedding_parameters)
    points: dict[tuple[str, str, str], list[SizePoint]] = defaultdict(list)
    for (variant, size), by_seed in runs.items():
        schemes = {scheme for scheme, _ in by_seed}
        for claim in CLAIMS:
            subjects = [s for s in LNS_FAMILY if s in schemes] if claim.subject == "lns" else (
                [claim.subject] if claim.subject in schemes else [])
            claim = dataclasses.replace(claim, against=reference) if claim.against == REFERENCE_SCHEME else claim
            for scheme in subjects:
                seeds, values, raws = _claim_values(claim, scheme, by_seed)
                if seeds:
                    points[(variant, claim.id, scheme)].append(
                        SizePoint(size, axis_values[size], parameters[size], seeds, values, raws))
    for series in points.values():
        series.sort(key=lambda p: p.axis_value)
    return points


def fit_trend(trend: Trend) -> Trend:
    """Least squares of every per-seed g on log2(axis value), the slope's 95 % t-interval, the verdict
    and the zero crossing (docs/depth_width_study.md, "The statistics against size")."""
    xs = [math.log2(p.axis_value) for p in trend.points for _ in p.values]
    ys = [v for p in trend.points for v in p.values]
    trend.n = len(ys)
    if trend.n < 3 or len({p.axis_value for p in trend.points}) < 2:
        return trend
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - y_mean - slope * (x - x_mean)) ** 2 for x, y in zip(xs, ys))
    half_width = t_quantile_975(trend.n - 2) * math.sqrt(residual / (trend.n - 2) / sxx)
    trend.slope, trend.slope_low, trend.slope_high = slope, slope - half_width, slope + half_width
    trend.centre = y_mean
    crossing_x = x_mean - y_mean / slope if slope != 0 else math.inf
    inside = min(xs) <= crossing_x <= max(xs)
    if trend.slope_low <= 0 <= trend.slope_high:
        trend.verdict = "holds"
    elif inside:
        trend.verdict = "turns"
    else:
        trend.verdict = "narrows" if slope * y_mean < 0 else "widens"
    if slope != 0:
        if trend.verdict == "narrows" or inside:
            trend.crossing = _crossing(trend, x_mean, y_mean, crossing_x, inside, max(xs))
    return trend


def _crossing(trend: Trend, x_mean: float, y_mean: float, crossing_x: float, inside: bool, x_max: float) -> Crossing:
    ends = None if trend.verdict == "holds" else sorted(2 ** (x_mean - y_mean / s)
                                                         for s in (trend.slope_low, trend.slope_high))
    sizes = {p.axis_value: p.parameters for p in trend.points}
    log_axis = [math.log2(value) for value in sizes]
    log_params = [math.log2(params) for params in sizes.values()]
    axis_mean, params_mean = statistics.fmean(log_axis), statistics.fmean(log_params)
    exponent = (sum((a - axis_mean) * (p - params_mean) for a, p in zip(log_axis, log_params))
                / sum((a - axis_mean) ** 2 for a in log_axis))
    parameters = 2 ** (params_mean + exponent * (crossing_x - axis_mean))
    return Crossing(axis_value=2 ** crossing_x, parameters=parameters, low=ends[0] if ends else None,
                    high=ends[1] if ends else None, inside=inside, beyond=2 ** (crossing_x - x_max))


def size_trends(analyses: Sequence[CheckpointAnalysis], size_axes: dict[str, list[str]], reference: str
                ) -> list[Trend]:
    """Every claim's fitted trend along every axis, in the order of the axes and ``CLAIMS``."""
    order = {claim.id: index for index, claim in enumerate(CLAIMS)}
    claims = {claim.id: claim for claim in CLAIMS}
    trends = []
    for axis, sizes in size_axes.items():
        points = size_points(analyses, axis, sizes, reference)
        for (variant, claim_id, scheme), series in sorted(points.items(), key=lambda item: (
                item[0][0], order[item[0][1]], item[0][2])):
            trends.append(fit_trend(Trend(variant, axis, claim_id, scheme, SIZE_FORMS[claim_id].label,
                                          _paper_sign(claims[claim_id]), series)))
    return trends


@dataclass
class SecondSeedCall:
    """The second-seed rule at one size that has a single paired seed."""

    variant: str
    size: str
    claims: list[str] = field(default_factory=list)
    """Comparative claims whose |g| is within the yardstick: they call for the second seed."""
    unjudged: list[str] = field(default_factory=list)
    """Comparative claims with no size of two seeds to take a yardstick from."""


def second_seed_calls(analyses: Sequence[CheckpointAnalysis], sizes: Sequence[str], reference: str
                      ) -> list[SecondSeedCall]:
    """At each size with one paired seed: the comparative claims whose |g| is no larger than the largest
    |g(seed a) − g(seed b)| of that claim at the sizes with two or more seeds."""
    points = size_points(analyses, None, sizes, reference)
    comparative = {claim.id for claim in CLAIMS if isinstance(claim.against, str)}
    yardstick: dict[tuple[str, str, str], float] = {}
    for key, series in points.items():
        spreads = [max(p.values) - min(p.values) for p in series if len(p.values) >= 2]
        if spreads:
            yardstick[key] = max(spreads)
    calls: dict[tuple[str, str], SecondSeedCall] = {}
    for key, series in points.items():
        variant, claim_id, _ = key
        if claim_id not in comparative:
            continue
        for point in series:
            if len(point.values) != 1:
                continue
            call = calls.setdefault((variant, point.size), SecondSeedCall(variant, point.size))
            if key not in yardstick:
                call.unjudged.append(claim_id)
            elif abs(point.values[0]) <= yardstick[key]:
                call.claims.append(claim_id)
    return list(calls.values())
