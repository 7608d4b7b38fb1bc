"""One small interface for every place a scalar goes, and the TensorBoard sink.

The trainer and ``tools/evaluate.py`` hand their scalars to a ``MetricSinks``, which filters out
values that are missing or not finite and passes the rest to each sink: ``TensorBoardSink`` (event
files under ``<run dir>/tensorboard``) and ``WandbSink`` (``lnstrain.tracking.wandb_sink``). A new
tracker is one more ``MetricSink``; nothing else in lnstrain names a tracker.

    sinks = open_run_sinks(run_dir, tensorboard=True, wandb=config.logging.wandb, ...)   # run_sinks.py
    sinks.log_scalars({"train/loss": 2.31, "train/lr": 3e-4}, step=100, tokens=409_600)
    sinks.log_layer_profiles({"depth_profile/residual_variance": [0.9, 1.4, 2.2]}, step=100)
    sinks.close()

``tokens`` (training tokens seen at ``step``) is the second x-axis: TensorBoard writes each scalar
again under ``by_tokens/<tag>`` with tokens as its step, W&B logs it as the ``tokens`` field.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path


BY_TOKENS_PREFIX = "by_tokens"


class MetricSink(ABC):
    """Somewhere scalars go. ``step`` is lnstrain's optimizer step (a checkpoint's, for evaluations)."""

    name: str = "sink"
    """What the console calls it."""

    @abstractmethod
    def log_scalars(self, scalars: Mapping[str, float], step: int, tokens: int | None = None) -> None:
        """Record ``scalars`` (tag -> finite value) at ``step``; ``tokens`` when the step has a token count."""

    def log_layer_profiles(self, profiles: Mapping[str, Sequence[float]], step: int) -> None:
        """Record per-layer values (tag -> [layer 1, ..., layer L]) at ``step``, as a value-against-depth view."""

    def close(self) -> None:
        """Flush and release everything (idempotent)."""


class TensorBoardSink(MetricSink):
    """Event files in ``log_dir``. A profile is a histogram whose bucket l holds layer l's value, so
    TensorBoard's Histograms tab draws value against depth, one curve per step."""

    name = "TensorBoard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard names its file from the time, host and PID and opens it for writing as it finds
        # it; a suffix nobody can guess means no link can have been planted there for it to write through
        self.writer = SummaryWriter(log_dir=str(log_dir), filename_suffix=f".{secrets.token_hex(8)}")

    def log_scalars(self, scalars: Mapping[str, float], step: int, tokens: int | None = None) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
            if tokens is not None:
                self.writer.add_scalar(f"{BY_TOKENS_PREFIX}/{tag}", value, tokens)

    def log_layer_profiles(self, profiles: Mapping[str, Sequence[float]], step: int) -> None:
        for tag, values in profiles.items():
            limits = [number + 0.5 for number in range(1, len(values) + 1)]
            self.writer.add_histogram_raw(tag, min=0.5, max=len(values) + 0.5, num=len(values), sum=sum(values),
                                          sum_squares=sum(v * v for v in values), bucket_limits=limits,
                                          bucket_counts=list(values), global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def finite_scalars(scalars: Mapping[str, float | None]) -> dict[str, float]:
    """The entries that are numbers and finite (a None, NaN or Inf is left out, as TensorBoard would
    draw nothing sensible for it)."""
    return {tag: float(value) for tag, value in scalars.items()
            if value is not None and math.isfinite(float(value))}


class MetricSinks(MetricSink):
    """Every sink of a run (none at all on ranks other than 0, or with both trackers off)."""

    def __init__(self, sinks: Sequence[MetricSink] = ()) -> None:
        self.sinks = list(sinks)

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log_scalars(self, scalars: Mapping[str, float | None], step: int, tokens: int | None = None) -> None:
        finite = finite_scalars(scalars)
        if finite:
            for sink in self.sinks:
                sink.log_scalars(finite, step, tokens)

    def log_layer_profiles(self, profiles: Mapping[str, Sequence[float]], step: int) -> None:
        for sink in self.sinks:
            sink.log_layer_profiles(profiles, step)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
