"""``train.eval_tasks``: lm-evaluation-harness tasks on checkpoints during training, on rank 0.

A checkpoint due for them is evaluated once its save is published: its completion marker and
``latest`` written, so it verifies as any reader would find it. A synchronous save is published
before ``save`` returns; one written in the background (``checkpoint.async_save``) at a later step
boundary, so its evaluation comes a few steps later and is recorded at its own step. It is read back
as the single-process model and scored through the Hugging Face export in memory
(``lnstrain.evaluation``), exactly as ``tools/evaluate.py`` would score it later, whatever the
layout: no weights are gathered from the live engine. The results go to
``<run dir>/downstream/step<N>.json`` and, as ``downstream/<task>/<metric>``, to the run's sinks at
that step. The other ranks go on to their next collective and wait there.

lm-eval seeds Python's, NumPy's and torch's generators: rank 0's states are put back afterwards, so
a run with evaluations trains exactly as one without. A failing evaluation (a data set that cannot
be downloaded, a task that breaks) is logged with its traceback and training goes on.
"""

from __future__ import annotations

import gc
import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lnstrain.checkpoint.metadata import capture_rng_state, restore_rng_state
from lnstrain.config.run_config import Config
from lnstrain.run_files import downstream_file
from lnstrain.training.metrics import MetricsLogger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DueCheckpoint:
    """A saved checkpoint that ``train.eval_tasks`` are due on, waiting for its save to be published."""

    step_dir: Path
    step: int
    tokens: int


class CheckpointEvaluator:
    """Decides which checkpoints ``train.eval_tasks`` are run on, and runs them on rank 0, in the
    training precision (``precision.dtype``) on rank 0's device."""

    def __init__(self, config: Config, rank: int, device: torch.device, metrics: MetricsLogger) -> None:
        self.config = config
        self.train = config.train
        self.rank = rank
        self.device = device
        self.metrics = metrics
        self._due: list[DueCheckpoint] = []

    def due(self, step: int, final: bool) -> bool:
        """Whether the checkpoint saved at ``step`` is to be evaluated (the same answer on every rank)."""
        if not self.train.eval_tasks:
            return False
        interval = self.train.eval_tasks_interval
        return final or bool(interval and step % interval == 0)

    def saved(self, step_dir: Path, step: int, tokens: int, final: bool) -> None:
        """The checkpoint of ``step`` was saved (its save maybe not yet published): remembered when due."""
        if self.due(step, final):
            self._due.append(DueCheckpoint(Path(step_dir), step, tokens))

    def evaluate_published(self, in_flight: Path | None, skip: bool = False) -> None:
        """Evaluate every remembered checkpoint but ``in_flight`` (whose files are still being written
        in the background): the others' saves are published, since saves publish in order. ``skip``:
        the run is stopping at once (a signal, the time limit), so they are not evaluated; rank 0 says
        how to evaluate them later."""
        waiting = [due for due in self._due if due.step_dir == in_flight]
        published, self._due = [due for due in self._due if due.step_dir != in_flight], waiting
        for due in published:
            if not skip:
                self.evaluate(str(due.step_dir), due.step, due.tokens)
            elif self.rank == 0:
                command = ["python", "tools/evaluate.py", "--checkpoint", str(due.step_dir), "--tasks",
                           ",".join(self.train.eval_tasks)]
                command += [part for path in self.train.eval_tasks_include_path for part in ("--include-path", path)]
                logger.warning("train.eval_tasks: the checkpoint of step %d is not evaluated, the run is stopping; "
                               "to evaluate it later: %s", due.step, shlex.join(command))

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
