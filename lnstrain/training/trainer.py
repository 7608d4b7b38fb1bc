"""The training loop: data -> engine steps -> logging, evaluation, checkpoints, clean stops.

``pretrain(config)`` runs on every rank after ``torch.distributed`` is initialised (the launcher does
that; tests use ``lnstrain.parallel.local_ranks.run_distributed``); the world size is torch.distributed's.
The data position is the global number of consumed samples: step ``s`` always trains on global batch
``s`` of the training set, so a resumed run sees exactly the batches the uninterrupted run would have
seen.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.locations import newest_checkpoint, remove_interrupted_saves
from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition
from lnstrain.checkpoint.metadata import write_atomically
from lnstrain.config.run_config import Config
from lnstrain.data import (CheckRecords, build_train_valid_datasets, check_token_ids, data_fingerprint,
                           iterate_micro_batches)
from lnstrain.estimate.snapshot_memory import background_save_refusal
from lnstrain.model.build import build_groups
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.run_files import FINAL_METRICS_FILE, RUN_CONFIG_FILE, FinalMetrics
from lnstrain.tracking.run_sinks import open_run_sinks
from lnstrain.training.eval_tasks import CheckpointEvaluator
from lnstrain.training.evaluation import evaluate, validation_samples
from lnstrain.training.health import LossSpikeDetector, NonFiniteGuard
from lnstrain.training.metrics import MetricsLogger, StepMetrics, perplexity
from lnstrain.training.outcome import EXIT_NONFINITE, EXIT_STOPPED
from lnstrain.training.preflight import tokenizer_checksum
from lnstrain.training.recovery import NonFiniteRecovery
from lnstrain.training.resume import restore_or_start
from lnstrain.training.run_lock import hold_run_directories, lock_directories
from lnstrain.training.signals import StopController
from lnstrain.training.stack_dumps import StackDumps
from lnstrain.wording import counted

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

logger = logging.getLogger(__name__)


@dataclass
class TrainingResult:
    """What a call to ``pretrain`` did (identical on every rank)."""

    position: TrainingPosition
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    stop_reason: str = "finished"
    resumed_from: str | None = None
    last_checkpoint: str | None = None
    exit_code: int = 0
    """``launch/pretrain.py``'s exit status (``lnstrain.training.outcome``): 0 finished, 75 stopped to be
    resumed, 3 stopped by non-finite losses."""
    rollbacks: list[str] = field(default_factory=list)
    """One entry per rollback: the checkpoint reloaded."""

    def record_rollback(self, checkpoint: Path, restored: TrainingPosition) -> None:
        """Training goes on from ``restored``: forget the losses of later steps (the replay records
        them again) and note the checkpoint reloaded."""
        for steps in (self.losses, self.eval_losses):
            for step in [s for s in steps if s > restored.step]:
                del steps[step]
        self.rollbacks.append(str(checkpoint))
        self.position = restored


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _depth_stats_collector(config: Config, engine: TrainingEngine, groups: ParallelGroups):
    """Per-layer statistics every ``logging.depth_stats_interval`` steps, when asked for and available."""
    if config.logging.depth_stats_interval <= 0:
        return None
    try:
        from lnstrain.analysis.depth_stats import DepthStatsCollector
    except ImportError:
        logger.warning("logging.depth_stats_interval is set but lnstrain.analysis.depth_stats is unavailable")
        return None
    return DepthStatsCollector(engine.module, groups, config.logging.depth_stats_interval, config.model.num_layers,
                               loss_scale=engine.current_loss_scale)


class Trainer:
    """One run on this rank: owns the engine, the datasets, the checkpoint manager and the loggers."""

    def __init__(self, config: Config) -> None:
        self.started = time.monotonic()  # train.exit_after_minutes counts from here
        self.config = config
        self.rank = dist.get_rank()
        self.groups = build_groups(config)
        seed_everything(config.train.seed + 100 * self.groups.pp_rank)  # tp/cp/dp peers share dropout seeds
        self.global_batch = config.train.global_batch_size
        self.micro_batch = config.train.micro_batch_size
        self.accumulation = config.grad_accumulation_steps(self.groups.world_size)
        self.total_steps = config.total_steps
        if self.rank == 0:
            config.save(config.run.dir / RUN_CONFIG_FILE)

        self.train_data, self.valid_data = build_train_valid_datasets(
            config.data, self.total_steps * self.global_batch,
            validation_samples(config.train.eval_batches, self.global_batch), config.train.seed,
            builds_cache=self.rank == 0, check_records=CheckRecords.for_this_node())
        check_token_ids([self.train_data, self.valid_data], config.model.vocab_size)

        from lnstrain.training.engine import build_engine

        self.engine = build_engine(config, self.groups)
        self.checkpoints = CheckpointManager(config, (self.groups.tp_size, self.groups.pp_size, self.groups.dcp_size),
                                             data_fingerprint(config.data), tokenizer_checksum(config))
        self.saves_in_background = self._saves_in_background()
        self.metrics = MetricsLogger(self.total_steps, config.tokens_per_step, is_writer=self.rank == 0)
        self.downstream = CheckpointEvaluator(config, self.rank, self.engine.device, self.metrics)
        self.depth_stats = _depth_stats_collector(config, self.engine, self.groups)
        self.guard = None
        if config.precision.dtype != "fp16":  # fp16: DeepSpeed's loss scaler skips overflowing steps
            self.guard = NonFiniteGuard(self.engine.module, self.engine.base_optimizer, self.engine.device)
        self.spikes = LossSpikeDetector(config.train.spike_window, config.train.spike_zscore)
        self.recovery = NonFiniteRecovery(config, self.engine, self.checkpoints)
        self._micro_batches = None
        self._iterator_at = -1

    def _open_sinks(self, position: TrainingPosition) -> None:
        """Rank 0's TensorBoard and W&B sinks; a run resumed from its checkpoint continues its W&B run."""
        if self.rank != 0:
            return
        logging_config = self.config.logging
        self.metrics.sinks = open_run_sinks(self.config.run.dir, tensorboard=logging_config.tensorboard,
                                            wandb=logging_config.wandb, run_name=self.config.run.name,
                                            config=self.config.to_dict(), continue_run=position.step > 0,
                                            wandb_failure_stops=False)

    def resume(self) -> tuple[TrainingPosition, Path | None]:
        """Restore this run's checkpoint (resharded when the layout changed), or start fresh, from
        ``checkpoint.init_from`` when given. Saves of an earlier launch that were cut off are removed
        first (rank 0, which holds the run directory)."""
        if self.rank == 0:
            remove_interrupted_saves(self.config.checkpoint_dir)
        return restore_or_start(self.config, self.engine, self.checkpoints, samples=len(self.train_data))

    def evaluate(self) -> float | None:
        train = self.config.train
        return evaluate(self.engine, self.valid_data, train.eval_batches, self.global_batch, self.micro_batch,
                        self.groups.dp_rank, self.groups.dp_size, vocab_size=self.config.model.vocab_size)

    def _saves_in_background(self) -> bool:
        """``checkpoint.async_save``, resolved from the config alone, so every rank decides alike (the
        pre-launch check refuses ``true`` where it cannot be)."""
        if self.config.checkpoint.async_save is False:
            return False
        refusal = background_save_refusal(self.config)
        if refusal is not None:
            logger.warning("checkpoints are written synchronously, training waiting for each: %s", refusal)
        return refusal is None

    def _save(self, position: TrainingPosition, stop: StopController, final: bool = False, stops: bool = False,
              urgent: bool = False) -> str | None:
        """The checkpoint written, or None when the state was not finite and nothing was saved.

        Written in the background (``checkpoint.async_save``) unless the run ends after it (``final``:
        training is done; ``stops``: it stops early), when waiting for it costs nothing: then it is
        published when this returns, as is every save before it. ``train.eval_tasks`` evaluate it when
        due, once it is published (``_evaluate_published``), unless the stop is ``urgent`` (a signal,
        the time limit, non-finite state).
        """
        ending = final or stops
        if ending:  # the wait is the stop's, not that of saves coming faster than they are written
            self.checkpoints.finish_background_save("the run is finished" if final else "the run stops")
        path = self.checkpoints.save(self.engine, position, in_background=self.saves_in_background and not ending)
        stop.record_save(self.checkpoints.slowest_save_s)
        if path is not None:
            self.downstream.saved(path, position.step, position.tokens_seen, final)
        self._evaluate_published(urgent)
        return str(path) if path is not None else None

    def _finish_save(self, stop: StopController, why: str) -> None:
        """Wait for the save written in the background, if any, and publish it (collective)."""
        self.checkpoints.finish_background_save(why)
        stop.record_save(self.checkpoints.slowest_save_s)
        self._evaluate_published()

    def _evaluate_published(self, urgent: bool = False) -> None:
        """``train.eval_tasks`` on the checkpoints due for them whose saves are published (the one still
        written in the background waits); skipped, and said so, when the run stops ``urgent``ly."""
        in_flight = self.checkpoints.in_flight
        self.downstream.evaluate_published(in_flight.step_dir if in_flight is not None else None, skip=urgent)

    def _last_good_checkpoint(self) -> str | None:
        """The checkpoint a resume would load now, verified (collective: every rank calls it)."""
        newest = newest_checkpoint(self.config.checkpoint_dir)
        if newest is None:
            return None
        try:
            verified, _ = self.checkpoints.verified_checkpoint(newest, fall_back=True)
        except CheckpointError:  # a file that would run code: not "good weights" to point at
            return None
        return str(verified) if verified is not None else None

    def _stop_not_finite(self, position: TrainingPosition, result: TrainingResult) -> TrainingResult:
        """A save found non-finite weights or optimizer state: every later step would build on them."""
        result.last_checkpoint = self._last_good_checkpoint()
        result.stop_reason = f"non-finite weights or optimizer state at step {position.step} (not saved)"
        result.exit_code = EXIT_NONFINITE
        logger.error("stopping: %s; the last good weights are in %s", result.stop_reason,
                     result.last_checkpoint or "no checkpoint (none was saved before)")
        return result

    def _record_eval(self, result: TrainingResult) -> None:
        loss = self.evaluate()
        if loss is not None:
            position = result.position
            result.eval_losses[position.step] = loss
            self.metrics.record_eval(position.step, position.tokens_seen, loss)

    def _next_batch(self, position: TrainingPosition) -> list:
        """This rank's micro-batches of global batch ``position.consumed_samples / global batch``."""
        start = position.consumed_samples
        if self._micro_batches is None or self._iterator_at != start:
            self._micro_batches = iterate_micro_batches(self.train_data, start, self.global_batch, self.micro_batch,
                                                        self.groups.dp_rank, self.groups.dp_size,
                                                        vocab_size=self.config.model.vocab_size)
        batch = list(itertools.islice(self._micro_batches, self.accumulation))
        if len(batch) < self.accumulation:
            raise RuntimeError(f"training data ran out at step {position.step + 1} ({start} samples consumed)")
        self._iterator_at = start + self.global_batch
        return batch

    def _step(self, batch: list, position: TrainingPosition, result: TrainingResult) -> tuple[float, bool]:
        """One optimizer step, its metrics and (when due) depth statistics; returns its duration and
        whether it was non-finite (its update then not applied)."""
        config = self.config
        depth_stats_now = self.depth_stats is not None and self.depth_stats.wants(position.step + 1)
        if depth_stats_now:
            self.depth_stats.arm()
        if self.guard is not None:
            self.guard.begin_step()
        started = time.perf_counter()
        callbacks = [self.guard.decide] if self.guard else []
        if depth_stats_now:  # parameter gradients as the optimizer gets them (before clipping)
            callbacks.insert(0, self.depth_stats.read_parameter_grads)
        step = self.engine.train_step(batch, before_optimizer_step=lambda: [run() for run in callbacks])
        seconds = time.perf_counter() - started
        # a step DeepSpeed skips without fp16's loss scaler had non-finite gradients (finite loss or not)
        gradients_nonfinite = step.skipped and step.loss_scale is None
        guarded = self.guard.end_step() if self.guard else False
        nonfinite = guarded or not math.isfinite(step.loss) or gradients_nonfinite
        if nonfinite and step.skipped:  # DeepSpeed skipped it (and its schedule step): keep lr = f(step)
            self.engine.scheduler.step()
        position.step += 1
        position.consumed_samples += self.global_batch
        position.tokens_seen += config.tokens_per_step
        result.losses[position.step] = float(step.loss)
        if nonfinite:
            position.nonfinite_steps += 1
            logger.warning("non-finite loss, output or gradients at step %d (loss %s): its update was not applied "
                           "(train.nonfinite_policy: %s)", position.step, step.loss, config.train.nonfinite_policy)
        spike = self.spikes.observe(float(step.loss))
        if spike is not None:
            position.loss_spikes += 1
            logger.warning("loss spike at step %d: %.4f is %.1f standard deviations above the mean of the last "
                           "%d steps", position.step, step.loss, spike, len(self.spikes.recent) - 1)
        self.metrics.record_step(StepMetrics(
            position.step, float(step.loss), float(step.lr), step.grad_norm, step.loss_scale, step.skipped,
            seconds, position.tokens_seen, position.nonfinite_steps, position.skipped_batches, position.loss_spikes),
            log_now=position.step % config.logging.interval == 0 or position.step == self.total_steps)
        if depth_stats_now and step.skipped:  # overflow or non-finite: its statistics would be too
            self.depth_stats.disarm()
            logger.info("depth statistics of step %d not recorded: the step was skipped", position.step)
        elif depth_stats_now:
            stats = self.depth_stats.collect(position.step)  # unscaled by the scale read when armed
            self.metrics.record_depth_stats(stats, position.step)
        return seconds, nonfinite

    def _write_final_metrics(self, result: TrainingResult) -> None:
        position = result.position
        loss = result.eval_losses.get(position.step)
        if self.rank != 0:
            return
        metrics = FinalMetrics(step=position.step, tokens=position.tokens_seen, eval_loss=loss,
                               eval_ppl=None if loss is None else perplexity(loss))  # also the "finished" marker
        write_atomically(self.config.run.dir / FINAL_METRICS_FILE, json.dumps(metrics, indent=2) + "\n")

    def train(self, stop_at_step: int | None = None) -> TrainingResult:
        """Train to ``config.total_steps``, or stop (saving) early on a signal, the wall-clock limit,
        non-finite losses (``train.nonfinite_policy``) or at ``stop_at_step`` (what a signal would do,
        at a chosen step: for tests and staged runs)."""
        config = self.config
        position, resumed_from = self.resume()
        result = TrainingResult(position, resumed_from=str(resumed_from) if resumed_from else None)
        stop = StopController(config.train.exit_after_minutes, config.checkpoint.interval_minutes,
                              self.engine.device, started=self.started).install()
        stacks = StackDumps(config.train.stack_dump_after_minutes).install()
        save_every, eval_every = config.checkpoint.interval_steps, config.train.eval_interval
        logger.info("training steps %d..%d of %d (%s of %s per rank per step, %s per step)",
                    position.step + 1, self.total_steps, self.total_steps,
                    counted(self.accumulation, "micro-batch", "micro-batches"), counted(self.micro_batch, "sample"),
                    counted(config.tokens_per_step, "token"))
        try:
            if stop_at_step is not None and stop_at_step <= position.step < self.total_steps:
                result.stop_reason = f"already at step {position.step}, stop_at_step {stop_at_step}"
                result.exit_code = EXIT_STOPPED
                logger.warning("not training: %s", result.stop_reason)
                return result
            self._open_sinks(position)
            while position.step < self.total_steps:
                stacks.iteration_started(position.step + 1)
                if self.recovery.must_skip(position):
                    self.recovery.skip_step(position)
                    seconds, nonfinite = 0.0, False
                else:
                    seconds, nonfinite = self._step(self._next_batch(position), position, result)
                verdict = self.recovery.after_step(nonfinite, position)
                if verdict.restored is not None:
                    result.record_rollback(verdict.rolled_back_to, verdict.restored)
                    position = result.position
                    continue
                if verdict.stop:
                    result.last_checkpoint = (self._save(position, stop, stops=True, urgent=True)
                                              or self._last_good_checkpoint())
                    result.stop_reason = self.recovery.stop_reason(position, len(result.rollbacks))
                    result.exit_code = EXIT_NONFINITE
                    logger.error("stopping: %s; the last good weights are saved in %s", result.stop_reason,
                                 result.last_checkpoint)
                    return result
                finished = position.step == self.total_steps
                if self.checkpoints.publish_if_written() is not None:  # the files of a save done in the background
                    stop.record_save(self.checkpoints.slowest_save_s)
                self._evaluate_published()  # also a save published by a rollback
                if eval_every and position.step % eval_every == 0 and not finished:
                    self._record_eval(result)
                decision = stop.poll(seconds, self.checkpoints.last_save_time,
                                     save_in_flight=self.checkpoints.in_flight is not None)
                urgent = decision.stop  # a signal or the time limit: no downstream evaluation before stopping
                if stop_at_step is not None and position.step >= stop_at_step:
                    decision.stop, decision.reason = True, f"reached stop_at_step {stop_at_step}"
                if not finished and (decision.stop or decision.save_for_time
                                     or (save_every and position.step % save_every == 0)):
                    saved = self._save(position, stop, stops=decision.stop, urgent=urgent)
                    if saved is None:
                        return self._stop_not_finite(position, result)
                    result.last_checkpoint = saved
                    self.recovery.checkpoint_saved()
                if decision.stop and not finished:
                    result.stop_reason = decision.reason
                    result.exit_code = EXIT_STOPPED
                    if self.rank == 0:  # the same decision on every rank
                        logger.warning("stopping after step %d: %s (checkpoint saved)", position.step, decision.reason)
                    return result
            self._record_eval(result)
            if config.checkpoint.save_at_end and self.checkpoints.last_saved_step != position.step:
                saved = self._save(position, stop, final=True)
                if saved is None:
                    return self._stop_not_finite(position, result)
                result.last_checkpoint = saved
            self._finish_save(stop, "the run is finished")  # before the marker of a finished run
            self._write_final_metrics(result)
            return result
        finally:
            stacks.uninstall()
            stop.uninstall()
            self.metrics.close()
            if self.guard is not None:
                self.guard.remove()


def pretrain(config: Config, stop_at_step: int | None = None) -> TrainingResult:
    """Train ``config`` on this rank (collective: every rank of the world calls it). Rank 0 holds the
    run directory for the whole run; if another trainer holds it, every rank raises
    ``RunDirectoryInUse`` before anything is written."""
    directories = lock_directories(config.run.dir, config.checkpoint_dir)
    with hold_run_directories(directories, dist.get_rank(), dist.get_world_size()):
        return Trainer(config).train(stop_at_step)
