"""Step times: summaries and paired comparisons of interleaved runs.

Runners are timed step by step in an interleaved order (A B, B A, A B, ...), so a slow patch on a
shared machine hits every runner alike. Two runners are then compared through the ratio of the
steps taken next to each other: the median of those ratios and a bootstrap 95% interval for it.
A difference is resolved when the interval excludes 1; "within 1%" needs an interval inside
[0.99, 1.01].
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np


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
