"""Step times: summaries and paired comparisons of interleaved runs.

Runners are timed step by step in an interleaved order, so a slow patch on a shared machine hits
every runner alike. The rounds follow a Williams design (``interleaved_order``): over a full cycle
every runner takes every position in a round, and follows every other runner, equally often (two
runners: A B, B A). With the earlier alternation (A B C D E, E D C B A) the first and last runners
each ran twice in a row and the others never did, so whatever one step leaves the next (caches, the
allocator's free blocks) favoured two of them. Two runners are then compared through the ratio of
the steps taken in the same round: the median of those ratios and a bootstrap 95% interval for it.
A difference is resolved when the interval excludes 1; "within 1%" needs an interval inside
[0.99, 1.01].
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np


def interleaved_order(runners: int, round_index: int) -> list[int]:
    """The runners' order in round ``round_index``: row ``round_index`` (cyclically) of a Williams
    design, whose rows are 0, 1, n-1, 2, n-2, ... shifted by the row number (for odd n, also each of
    those reversed): n rows for even n, 2n for odd n, in which each runner holds each position and
    directly follows each other runner equally often. The rows are ordered so that a round does not
    start with the runner that ended the previous one (with two runners that cannot be avoided)."""
    if runners < 1:
        raise ValueError(f"interleaved_order needs at least one runner, got {runners}")
    base = [0]
    for offset in range(1, runners):
        base.append((offset + 1) // 2 if offset % 2 else runners - offset // 2)
    rows = [[(position + shift) % runners for position in base] for shift in range(runners)]
    if runners % 2:
        rows += [row[::-1] for row in rows]
    ordered = [rows.pop(0)]
    while rows:  # no runner twice in a row across rounds either, where the rows allow it
        following = next((row for row in rows if row[0] != ordered[-1][-1]), rows[0])
        rows.remove(following)
        ordered.append(following)
    return ordered[round_index % len(ordered)]


@dataclass(frozen=True)
class TimingSummary:
    """Seconds per step over the measured steps (warm-up excluded)."""

    median: float
    mean: float
    min: float
    max: float
    p10: float
    p90: float
    samples: list[float]

    @property
    def relative_spread(self) -> float:
        """(p90 - p10) / median: how noisy the steps were."""
        return (self.p90 - self.p10) / self.median

    def to_dict(self) -> dict:
        return {**asdict(self), "relative_spread": self.relative_spread}


def summarize(seconds: list[float]) -> TimingSummary:
    if not seconds:
        raise ValueError("no measured steps to summarize (--steps must be >= 1)")
    p10, p90 = np.percentile(seconds, [10, 90]).tolist()
    return TimingSummary(median=statistics.median(seconds), mean=statistics.fmean(seconds), min=min(seconds),
                         max=max(seconds), p10=p10, p90=p90, samples=list(seconds))


@dataclass(frozen=True)
class PairedRatio:
    """Step time of ``runner`` over ``reference``, from steps taken next to each other."""

    runner: str
    reference: str
    median_ratio: float
    ci95: tuple[float, float]
    pairs: int

    def to_dict(self) -> dict:
        return {**asdict(self), "ci95": list(self.ci95)}


def paired_ratio(runner: str, times: list[float], reference: str, reference_times: list[float],
                 resamples: int = 2000, seed: int = 0) -> PairedRatio:
    """Median of ``times[i] / reference_times[i]`` with a percentile-bootstrap 95% interval."""
    if len(times) != len(reference_times) or not times:
        raise ValueError(f"paired_ratio needs equally many steps of {runner!r} ({len(times)}) and "
                         f"{reference!r} ({len(reference_times)}), at least one")
    ratios = np.asarray(times) / np.asarray(reference_times)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(ratios, size=(resamples, ratios.size), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5]).tolist()
    return PairedRatio(runner=runner, reference=reference, median_ratio=float(np.median(ratios)),
                       ci95=(low, high), pairs=int(ratios.size))
