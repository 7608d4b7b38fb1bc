"""The sinks of a run directory: its TensorBoard event files and its W&B run, as its config asks."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lnstrain.run_files import TENSORBOARD_DIR
from lnstrain.tracking.config import WandbConfig
from lnstrain.tracking.sinks import MetricSink, MetricSinks, TensorBoardSink

logger = logging.getLogger(__name__)


def open_run_sinks(run_dir: Path, *, tensorboard: bool, wandb: WandbConfig, run_name: str,
                   config: Mapping[str, Any] | None = None, continue_run: bool = True,
                   skip_logged_steps: bool = True, wandb_failure_stops: bool = True) -> MetricSinks:
    """The sinks of the run in ``run_dir``: TensorBoard under ``<run dir>/tensorboard`` when
    ``tensorboard``, and W&B when ``wandb.mode`` is not ``disabled``.

    ``continue_run``: continue the run directory's W&B run (a resumed trainer, a tool); False starts a
    new one (a trainer starting at step 0). ``skip_logged_steps``: steps the W&B run already has are
    not logged again (the trainer's replay after a resume); a tool that records an evaluation of an
    older checkpoint passes False. ``wandb_failure_stops``: False logs a W&B run that cannot be started
    (no network, no login) as an error and goes on without it (a trainer: TensorBoard still has
    everything). Call on one process only (rank 0).
    """
    sinks: list[MetricSink] = []
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
    if wandb.enabled:
        from lnstrain.tracking.wandb_sink import WandbSink

        try:
            sinks.append(WandbSink(wandb, run_dir, run_name, config, continue_run, skip_logged_steps))
        except Exception as error:  # noqa: BLE001  (whatever wandb raises; the caller decides what it costs)
            if wandb_failure_stops:
                MetricSinks(sinks).close()
                raise
            logger.error("W&B (logging.wandb.mode %s) could not start, so this launch logs without it: %s",
                         wandb.mode, error)
    return MetricSinks(sinks)
