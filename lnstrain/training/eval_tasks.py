"""``train.eval_tasks``: lm-evaluation-harness tasks on checkpoints during training, on rank 0.

The checkpoint just saved is read back as the single-process model and scored through the Hugging
Face export in memory (``lnstrain.evaluation``), exactly as ``tools/evaluate.py`` would score it
later, whatever the layout: no weights are gathered from the live engine. The results go to
``<run dir>/downstream/step<N>.json`` and, as ``downstream/<task>/<metric>``, to the run's sinks at
that step. The other ranks go on to their next collective and wait there.

lm-eval seeds Python's, NumPy's and torch's generators: rank 0's states are put back afterwards, so
a run with evaluations trains exactly as one without. A failing evaluation (a data set that cannot
be downloaded, a task that breaks) is logged with its traceback and training goes on.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from lnstrain.checkpoint.metadata import capture_rng_state, restore_rng_state
from lnstrain.config.run_config import Config
from lnstrain.run_files import downstream_file
from lnstrain.training.metrics import MetricsLogger

logger = logging.getLogger(__name__)

class CheckpointEvaluator:
    """Decides which checkpoints ``train.eval_tasks`` are run on, and runs them on rank 0, in the
    training precision (``precision.dtype``) on rank 0's device."""

    def __init__(self, config: Config, rank: int, device: torch.device, metrics: MetricsLogger) -> None:
        self.config = config
        self.train = config.train
        self.rank = rank
        self.device = device
        self.metrics = metrics

    def due(self, step: int, final: bool) -> bool:
        """Whether the checkpoint saved at ``step`` is to be evaluated (the same answer on every rank)."""
        if not self.train.eval_tasks:
            return False
        interval = self.train.eval_tasks_interval
        return final or bool(interval and step % interval == 0)

    def evaluate(self, step_dir: str, step: int, tokens: int) -> None:
        """Rank 0: evaluate the checkpoint in ``step_dir`` (skipped when its results exist); other ranks return."""
        if self.rank != 0:
            return
        output = downstream_file(self.config.run.dir, step)
        if output.is_file():
            logger.info("downstream results of step %d exist (%s): not evaluated again", step, output)
            return
        from lnstrain.evaluation.downstream import DownstreamTasks, evaluate_downstream
        from lnstrain.checkpoint.verifier import Trust
        from lnstrain.evaluation.hf_model import load_checkpoint_model
        from lnstrain.evaluation.results import logged_scalars, write_results

        tasks = DownstreamTasks(list(self.train.eval_tasks), list(self.train.eval_tasks_include_path),
                                limit=self.train.eval_tasks_limit)
        states = capture_rng_state()
        started = time.monotonic()
        try:
            trust = Trust.from_config(self.config.checkpoint, [self.config.run.dir, self.config.checkpoint_dir])
            model = load_checkpoint_model(step_dir, self.config.precision.dtype, self.device, trust)
            results = evaluate_downstream(model, tasks)
            del model
            write_results(results, output)
            self.metrics.record_scalars(logged_scalars(results["metrics"]), step, tokens)
        except Exception:  # noqa: BLE001  (an evaluation never stops training)
            logger.exception("downstream evaluation of %s failed; training goes on", step_dir)
        finally:
            restore_rng_state(states)
            gc.collect()
        seconds = time.monotonic() - started
        limit = self.train.collective_timeout_minutes * 60
        if seconds > limit / 2:
            logger.warning("the downstream evaluation took %.0f s while the other ranks waited; at %.0f s "
                           "(train.collective_timeout_minutes) they stop: set train.eval_tasks_limit or raise the "
                           "timeout", seconds, limit)
