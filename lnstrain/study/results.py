"""A run's final evaluation, wherever the trainer left it.

Preferred: ``<run dir>/final_metrics.json`` (``run_files.FinalMetrics``), written once when a run
finishes. Fallback: the TensorBoard scalar ``eval/loss`` under
``<run dir>/tensorboard`` (the trainer's metrics logger), accepted only at the run's last step, so a
run stopped early never counts as finished.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from lnstrain.run_files import EVAL_LOSS_TAG, FINAL_METRICS_FILE, TENSORBOARD_DIR, read_final_metrics
from lnstrain.training.outcome import finished_step

logger = logging.getLogger(__name__)


def _from_tensorboard(run_dir: Path, total_steps: int) -> dict | None:
    event_dir = run_dir / TENSORBOARD_DIR
    if not event_dir.is_dir() or not any(event_dir.rglob("events.out.tfevents.*")):
        return None
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        logger.warning("%s has TensorBoard logs but tensorboard is not installed to read them", run_dir)
        return None
    last = None
    for events_file in sorted(event_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events_file), size_guidance={"scalars": 0}).Reload()
        if EVAL_LOSS_TAG in accumulator.Tags().get("scalars", []):
            for event in accumulator.Scalars(EVAL_LOSS_TAG):
                if event.step == total_steps:
                    last = event
    if last is None:
        return None
    return {"step": last.step, "tokens": "", "eval_loss": last.value, "eval_ppl": math.exp(last.value),
            "source": TENSORBOARD_DIR}


def final_metrics(run_dir: Path, total_steps: int) -> dict | None:
    """The finished run's final metrics, or None if the run has not finished."""
    metrics = read_final_metrics(run_dir) if finished_step(run_dir, total_steps) is not None else None
    if metrics is not None:
        loss = math.nan if metrics.get("eval_loss") is None else float(metrics["eval_loss"])  # None: no eval data
        return {"step": metrics.get("step", ""), "tokens": metrics.get("tokens", ""), "eval_loss": loss,
                "eval_ppl": float(metrics.get("eval_ppl") or math.exp(loss)), "source": FINAL_METRICS_FILE}
    return _from_tensorboard(run_dir, total_steps)
