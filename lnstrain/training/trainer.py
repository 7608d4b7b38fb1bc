"""The training loop: data -> engine steps -> logging, evaluation, checkpoints, clean stops.

``pretrain(config, world_size)`` runs on every rank after ``torch.distributed`` is initialised (the
launcher does that; tests use ``lnstrain.testing.run_distributed``). The data position is the global
number of consumed samples: step ``s`` always trains on global batch ``s`` of the training set, so
a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition, resolve_resume
from lnstrain.config.run_config import Config
from lnstrain.data import build_train_valid_datasets, check_token_ids, data_fingerprint, iterate_micro_batches
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.training.evaluation import evaluate, validation_samples
from lnstrain.training.metrics import MetricsLogger, StepMetrics
from lnstrain.training.preflight import tokenizer_checksum
from lnstrain.training.signals import StopController

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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _depth_stats_collector(config: Config, module: Any, groups: ParallelGroups):
    """Per-layer statistics every ``logging.depth_stats_interval`` steps, when asked for and available."""
    if config.logging.depth_stats_interval <= 0:
        return None
    try:
        from lnstrain.analysis.depth_stats import DepthStatsCollector
    except ImportError:
        logger.warning("logging.depth_stats_interval is set but lnstrain.analysis.depth_stats is unavailable")
        return None
    return DepthStatsCollector(module, groups, config.logging.depth_stats_interval, config.model.num_layers)


class Trainer:
    """One run on this rank: owns the engine, the datasets, the checkpoint manager and the loggers."""

    def __init__(self, config: Config, world_size: int) -> None:
        self.config = config
        self.world_size = world_size
        self.rank = dist.get_rank()
        par = config.parallel
        self.groups = ParallelGroups.build(par.tensor, par.pipeline, par.sequence_parallel)
        seed_everything(config.train.seed + 100 * self.groups.pp_rank)  # tp/dp peers share dropout seeds
        self.global_batch = config.train.global_batch_size
        self.micro_batch = config.train.micro_batch_size
        self.accumulation = config.grad_accumulation_steps(world_size)
        self.total_steps = config.total_steps
        if self.rank == 0:
            config.save(config.run.dir / "config.yaml")

        self.train_data, self.valid_data = build_train_valid_datasets(
            config.data, self.total_steps * self.global_batch,
            validation_samples(config.train.eval_batches, self.global_batch), config.train.seed,
            builds_cache=self.rank == 0)
        check_token_ids([self.train_data, self.valid_data], config.model.vocab_size)

        from lnstrain.training.engine import build_engine

        self.engine = build_engine(config, self.groups, world_size)
        self.checkpoints = CheckpointManager(
            config, world_size, (self.groups.tp_size, self.groups.pp_size, self.groups.dp_size),
            data_fingerprint(config.data), tokenizer_checksum(config))
        self.metrics = MetricsLogger(self.total_steps, config.tokens_per_step, is_writer=self.rank == 0,
                                     tensorboard_dir=config.run.dir / "tensorboard" if config.logging.tensorboard else None)
        self.depth_stats = _depth_stats_collector(config, self.engine.module, self.groups)

    def resume(self) -> tuple[TrainingPosition, Path | None]:
        step_dir, problems = resolve_resume(self.config.checkpoint.resume, self.config.checkpoint_dir)
        if problems:
            raise ValueError("cannot resume:\n  - " + "\n  - ".join(problems))
        if step_dir is None:
            return TrainingPosition(), None
        return self.checkpoints.load(self.engine.engine, step_dir), step_dir

    def evaluate(self) -> float | None:
        train = self.config.train
        return evaluate(self.engine, self.valid_data, train.eval_batches, self.global_batch, self.micro_batch,
                        self.groups.dp_rank, self.groups.dp_size)

    def _save(self, position: TrainingPosition, stop: StopController) -> str:
        started = time.monotonic()
        path = self.checkpoints.save(self.engine.engine, position)
        stop.record_save(time.monotonic() - started)
        return str(path)

    def _record_eval(self, result: TrainingResult) -> None:
        loss = self.evaluate()
        if loss is not None:
            position = result.position
            result.eval_losses[position.step] = loss
            self.metrics.record_eval(position.step, position.tokens_seen, loss)

    def _step(self, batch: list, position: TrainingPosition, result: TrainingResult) -> float:
        """One optimizer step, its metrics and (when due) depth statistics; returns its duration."""
        config = self.config
        depth_stats_now = self.depth_stats is not None and self.depth_stats.wants(position.step + 1)
        if depth_stats_now:
            self.depth_stats.arm()
        started = time.perf_counter()
        step = self.engine.train_step(batch)
        seconds = time.perf_counter() - started
        position.step += 1
        position.consumed_samples += self.global_batch
        position.tokens_seen += config.tokens_per_step
        result.losses[position.step] = float(step.loss)
        self.metrics.record_step(StepMetrics(
            position.step, float(step.loss), float(step.lr), step.grad_norm, step.loss_scale, step.skipped,
            seconds, position.tokens_seen), log_now=position.step % config.logging.interval == 0)
        if depth_stats_now:
            stats = self.depth_stats.collect(position.step, step.loss_scale or 1.0)
            self.metrics.record_depth_stats(stats, position.step)
        return seconds

    def train(self, stop_at_step: int | None = None) -> TrainingResult:
        """Train to ``config.total_steps``, or stop (saving) early on a signal, the wall-clock limit or
        at ``stop_at_step`` (what a signal would do, at a chosen step: for tests and staged runs)."""
        config = self.config
        position, resumed_from = self.resume()
        result = TrainingResult(position, resumed_from=str(resumed_from) if resumed_from else None)
        stop = StopController(config.train.max_wallclock_minutes, config.checkpoint.interval_minutes,
                              self.engine.device).install()
        micro_batches = iterate_micro_batches(self.train_data, position.consumed_samples, self.global_batch,
                                              self.micro_batch, self.groups.dp_rank, self.groups.dp_size)
        save_every, eval_every = config.checkpoint.interval_steps, config.train.eval_interval
        logger.info("training steps %d..%d of %d (%d micro-batches of %d per rank per step, %d tokens per step)",
                    position.step + 1, self.total_steps, self.total_steps, self.accumulation, self.micro_batch,
                    config.tokens_per_step)
        try:
            while position.step < self.total_steps:
                batch = list(itertools.islice(micro_batches, self.accumulation))
                if len(batch) < self.accumulation:
                    raise RuntimeError(f"training data ran out at step {position.step + 1} "
                                       f"({position.consumed_samples} samples consumed)")
                seconds = self._step(batch, position, result)
                finished = position.step == self.total_steps
                if eval_every and position.step % eval_every == 0 and not finished:
                    self._record_eval(result)
                decision = stop.poll(seconds, self.checkpoints.last_save_time)
                if stop_at_step is not None and position.step >= stop_at_step:
                    decision.stop, decision.reason = True, f"reached stop_at_step {stop_at_step}"
                if not finished and (decision.stop or decision.save_for_time
                                     or (save_every and position.step % save_every == 0)):
                    result.last_checkpoint = self._save(position, stop)
                if decision.stop and not finished:
                    result.stop_reason = decision.reason
                    logger.warning("stopping after step %d: %s (checkpoint saved)", position.step, decision.reason)
                    return result
            self._record_eval(result)
            if config.checkpoint.save_at_end and self.checkpoints.last_saved_step != position.step:
                result.last_checkpoint = self._save(position, stop)
            return result
        finally:
            stop.uninstall()
            self.metrics.close()


def pretrain(config: Config, world_size: int, stop_at_step: int | None = None) -> TrainingResult:
    """Train ``config`` on this rank (collective: every rank of the world calls it)."""
    return Trainer(config, world_size).train(stop_at_step)
