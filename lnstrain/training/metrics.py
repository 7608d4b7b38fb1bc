"""Progress lines on the console, and scalars to the run's sinks (rank 0 only).

The sinks are TensorBoard and W&B (``lnstrain.tracking.sinks``). Training and validation scalars
carry the tokens seen as a second x-axis (TensorBoard: ``by_tokens/<tag>``), so runs with different
batch sizes can be compared on one plot.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from lnstrain.run_files import EVAL_LOSS_TAG
from lnstrain.tracking.sinks import MetricSinks

logger = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    """One optimizer step as the engine reported it."""

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    loss_scale: float | None
    skipped: bool
    step_seconds: float
    tokens_seen: int
    nonfinite_steps: int = 0
    """Run totals (kept in checkpoints): non-finite steps, global batches skipped, loss spikes."""
    skipped_batches: int = 0
    loss_spikes: int = 0


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLogger:
    """Averages steps over each logging interval, prints one line, hands the scalars to the sinks.

    Args:
        is_writer: only the writing rank (global rank 0) prints progress and has sinks.
        sinks: where scalars go (empty on other ranks, or with every tracker off).
    """

    def __init__(self, total_steps: int, tokens_per_step: int, is_writer: bool, sinks: MetricSinks | None = None) -> None:
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.is_writer = is_writer
        self.sinks = sinks if sinks is not None else MetricSinks()
        self._window: list[StepMetrics] = []
        self._started = time.monotonic()
        self._steps_this_run = 0

    def record_step(self, metrics: StepMetrics, log_now: bool) -> None:
        self._window.append(metrics)
        self._steps_this_run += 1
        if metrics.skipped and metrics.loss_scale is not None:
            logger.warning("step %d skipped by the loss scaler (overflow); loss scale now %s",
                           metrics.step, metrics.loss_scale)
        if not log_now and self._steps_this_run > 1:  # the first step of a launch always: it shows the start worked
            return
        window, self._window = self._window, []
        if not self.is_writer:
            return
        seconds = sum(m.step_seconds for m in window)
        tokens_per_s = len(window) * self.tokens_per_step / max(seconds, 1e-9)
        finite = [m.loss for m in window if math.isfinite(m.loss)]
        loss = sum(finite) / len(finite) if finite else math.nan
        last = window[-1]
        elapsed = time.monotonic() - self._started
        eta = elapsed / self._steps_this_run * (self.total_steps - last.step)
        grad_norm = "n/a" if last.grad_norm is None else f"{last.grad_norm:.3f}"
        scale = "" if last.loss_scale is None else f" | loss scale {last.loss_scale:g}"
        health = (f" | non-finite {last.nonfinite_steps} | skipped batches {last.skipped_batches} | "
                  f"spikes {last.loss_spikes}") if (last.nonfinite_steps or last.skipped_batches or last.loss_spikes) else ""
        logger.info("step %d/%d | loss %.4f | lr %.3e | grad norm %s | %.0f tokens/s | %s tokens | ETA %s%s%s",
                    last.step, self.total_steps, loss, last.lr, grad_norm, tokens_per_s,
                    f"{last.tokens_seen:,}", format_duration(eta), scale, health)
        self.sinks.log_scalars({
            "train/loss": loss, "train/lr": last.lr, "train/grad_norm": last.grad_norm,
            "train/loss_scale": last.loss_scale, "train/tokens_per_s": tokens_per_s,
            "train/tokens_seen": float(last.tokens_seen), "train/nonfinite_steps": float(last.nonfinite_steps),
            "train/skipped_batches": float(last.skipped_batches), "train/loss_spikes": float(last.loss_spikes),
        }, last.step, last.tokens_seen)

    def record_eval(self, step: int, tokens_seen: int, loss: float) -> None:
        if not self.is_writer:
            return
        logger.info("eval at step %d | loss %.4f | perplexity %.2f", step, loss, perplexity(loss))
        self.sinks.log_scalars({EVAL_LOSS_TAG: loss, "eval/perplexity": perplexity(loss)}, step, tokens_seen)

    def record_depth_stats(self, stats: dict[str, float], step: int) -> None:
        """``DepthStatsCollector.collect``'s scalars, and one value-against-depth profile per statistic."""
        if not self.sinks:
            return
        from lnstrain.analysis.depth_stats import PROFILE_PREFIX, layer_profiles

        self.sinks.log_scalars(stats, step)
        self.sinks.log_layer_profiles({f"{PROFILE_PREFIX}/{stat}": values
                                       for stat, values in layer_profiles(stats).items()}, step)

    def record_scalars(self, scalars: dict[str, float], step: int, tokens_seen: int | None = None) -> None:
        """Other scalars at ``step`` (downstream accuracy)."""
        if self.is_writer:
            self.sinks.log_scalars(scalars, step, tokens_seen)

    def close(self) -> None:
        self.sinks.close()
