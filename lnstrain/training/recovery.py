"""What a run does about batches it must not train on, and about steps that went non-finite.

A batch is never trained on when it lies in ``train.skip_sample_ranges`` or in a range a rollback
marked; its step still moves the data position and the learning-rate schedule on. A non-finite step
(its update is never applied) is skipped, rolled back from the newest checkpoint or ends the run, as
``train.nonfinite_policy`` and ``train.max_nonfinite_in_a_row`` say.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lnstrain.checkpoint.locations import newest_checkpoint
from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition
from lnstrain.config.run_config import Config

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryDecision:
    """What the train loop does after a step; the loop applies it to its own record of the run."""

    restored: TrainingPosition | None = None
    """Set after a rollback: the position to train on from now. Losses recorded for later steps are
    forgotten (the replay records them again)."""
    rolled_back_to: Path | None = None
    """Set after a rollback: the checkpoint reloaded."""
    stop: bool = False
    """The run must stop (saving the last good weights)."""


class NonFiniteRecovery:
    """Skipped sample ranges, the non-finite policy and rollbacks for one run on this rank."""

    def __init__(self, config: Config, engine: TrainingEngine, checkpoints: CheckpointManager) -> None:
        self.config = config
        self.engine = engine
        self.checkpoints = checkpoints
        self.global_batch = config.train.global_batch_size
        self.rolled_back_ranges: list[list[int]] = []
        """The ``[start, end)`` ranges of the batches this run rolled back from, this session."""
        self.bad_in_a_row = 0
        """Non-finite steps in a row, up to the step just taken."""
        self.rollbacks_in_a_row = 0
        """Rollbacks since the last checkpoint saved."""

    def must_skip(self, position: TrainingPosition) -> bool:
        """Whether the next global batch lies in ``train.skip_sample_ranges`` or a rolled-back range."""
        start, end = position.consumed_samples, position.consumed_samples + self.global_batch
        ranges = self.config.train.skip_sample_ranges + position.skipped_sample_ranges
        return any(a < end and start < b for a, b in ranges)

    def skip_step(self, position: TrainingPosition) -> None:
        """A step without training: the data position and the learning-rate schedule move on."""
        logger.warning("step %d: skipping samples [%d, %d) (train.skip_sample_ranges or a rollback)",
                       position.step + 1, position.consumed_samples, position.consumed_samples + self.global_batch)
        self.engine.scheduler.step()
        position.step += 1
        position.consumed_samples += self.global_batch
        position.skipped_batches += 1

    def after_step(self, nonfinite: bool, position: TrainingPosition) -> RecoveryDecision:
        """Apply ``train.nonfinite_policy`` to the step just taken: train on, roll back or stop."""
        train = self.config.train
        self.bad_in_a_row = self.bad_in_a_row + 1 if nonfinite else 0
        if not nonfinite:
            return RecoveryDecision()
        if train.nonfinite_policy == "rollback" and self.rollbacks_in_a_row < train.max_nonfinite_in_a_row:
            rollback = self.roll_back(position)
            if rollback is not None:
                self.rollbacks_in_a_row += 1
                return rollback
        if train.nonfinite_policy != "skip" or self.bad_in_a_row >= train.max_nonfinite_in_a_row:
            return RecoveryDecision(stop=True)
        position.skipped_batches += 1
        return RecoveryDecision()

    def stop_reason(self, position: TrainingPosition, rollbacks: int) -> str:
        """Why the run stops; ``rollbacks``: how many this run made."""
        policy = self.config.train.nonfinite_policy
        return (f"non-finite loss at step {position.step} (train.nonfinite_policy: {policy}, "
                f"{self.bad_in_a_row} in a row, {rollbacks} rollbacks)")

    def checkpoint_saved(self) -> None:
        """A newer checkpoint to roll back to: rollbacks count from zero again."""
        self.rollbacks_in_a_row = 0

    def roll_back(self, position: TrainingPosition) -> RecoveryDecision | None:
        """Reload the newest checkpoint whose files verify and never train on the batch that just
        failed; None when there is no checkpoint to go back to."""
        self.checkpoints.finish_background_save("rolling back")  # the newest checkpoint may be in flight
        step_dir = newest_checkpoint(self.config.checkpoint_dir)
        if step_dir is not None:
            step_dir, _ = self.checkpoints.verified_checkpoint(step_dir, fall_back=True)
        if step_dir is None:
            return None
        self.rolled_back_ranges.append([position.consumed_samples - self.global_batch, position.consumed_samples])
        restored = self.checkpoints.load(self.engine, step_dir)
        self.engine.follow_lr_schedule(self.engine.lr_schedule)  # this launch's, even from an older launch's checkpoint
        ranges = {tuple(r) for r in restored.skipped_sample_ranges + self.rolled_back_ranges}
        restored.skipped_sample_ranges = [list(r) for r in sorted(ranges)]
        # the counters keep what happened since; the jump over the failed batch counts it as skipped
        restored.nonfinite_steps, restored.loss_spikes = position.nonfinite_steps, position.loss_spikes
        restored.skipped_batches = position.skipped_batches  # the replay counts the failed batch when it skips it
        logger.warning("rolled back to %s (step %d); samples %s will be skipped", step_dir, restored.step,
                       restored.skipped_sample_ranges)
        return RecoveryDecision(restored=restored, rolled_back_to=step_dir)
