"""Progress lines on the console and scalars in TensorBoard (rank 0 only).

Every scalar is written twice: under its own tag with the optimizer step as x-axis, and under
``by_tokens/<tag>`` with the number of training tokens seen as x-axis, so runs with different batch
sizes can be compared on one plot.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from lnstrain.run_files import EVAL_LOSS_TAG

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
    """Averages steps over each logging interval, prints one line, writes TensorBoard scalars.

    Args:
        is_writer: only the writing rank (global rank 0) prints progress and owns the event files.
        tensorboard_dir: where event files go; None disables TensorBoard.
    """

    def __init__(self, total_steps: int, tokens_per_step: int, is_writer: bool,
                 tensorboard_dir: Path | None) -> None:
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.is_writer = is_writer
        self.writer = None
        if is_writer and tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tensorboard_dir))
        self._window: list[StepMetrics] = []
        self._started = time.monotonic()
        self._steps_this_run = 0

    def scalar(self, tag: str, value: float | None, step: int, tokens_seen: int) -> None:
        if self.writer is None or value is None or not math.isfinite(value):
            return
        self.writer.add_scalar(tag, value, step)
        self.writer.add_scalar(f"by_tokens/{tag}", value, tokens_seen)

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
        for tag, value in (("train/loss", loss), ("train/lr", last.lr), ("train/grad_norm", last.grad_norm),
                           ("train/loss_scale", last.loss_scale), ("train/tokens_per_s", tokens_per_s),
                           ("train/tokens_seen", float(last.tokens_seen)),
                           ("train/nonfinite_steps", float(last.nonfinite_steps)),
                           ("train/skipped_batches", float(last.skipped_batches)),
                           ("train/loss_spikes", float(last.loss_spikes))):
            self.scalar(tag, value, last.step, last.tokens_seen)

    def record_eval(self, step: int, tokens_seen: int, loss: float) -> None:
        if not self.is_writer:
            return
        logger.info("eval at step %d | loss %.4f | perplexity %.2f", step, loss, perplexity(loss))
        self.scalar(EVAL_LOSS_TAG, loss, step, tokens_seen)
        self.scalar("eval/perplexity", perplexity(loss), step, tokens_seen)

    def record_depth_stats(self, stats: dict[str, float], step: int) -> None:
        if self.writer is not None:
            from lnstrain.analysis.depth_stats import write_depth_stats

            write_depth_stats(self.writer, stats, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
