"""Where a run starts: its own checkpoint (resharded when the parallel layout changed), the weights
named by ``checkpoint.init_from``, or step 0."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition, resolve_resume
from lnstrain.checkpoint.metadata import read_metadata
from lnstrain.config.run_config import Config

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

logger = logging.getLogger(__name__)


def _cannot_resume(problems: list[str]) -> ValueError:
    return ValueError("cannot resume:\n  - " + "\n  - ".join(problems))


def restore_or_start(config: Config, engine: TrainingEngine,
                     checkpoints: CheckpointManager) -> tuple[TrainingPosition, Path | None]:
    """Load the checkpoint ``checkpoint.resume`` names into ``engine`` and return its position and
    directory; with none to resume, initialise from ``checkpoint.init_from`` when given and return
    step 0 and None. Collective: every rank calls it."""
    step_dir, problems = resolve_resume(config.checkpoint.resume, config.checkpoint_dir)
    if problems:
        raise _cannot_resume(problems)
    if step_dir is None:
        if config.checkpoint.init_from:
            from lnstrain.checkpoint.reshard import initialize_from

            logger.info("initialising the model from %s (checkpoint.init_from)", config.checkpoint.init_from)
            initialize_from(engine, config.checkpoint.init_from, config.checkpoint.init_from_unfold_lns)
        return TrainingPosition(), None
    logger.info("loading checkpoint %s", step_dir)
    return load_checkpoint(config, engine, checkpoints, step_dir), step_dir


def load_checkpoint(config: Config, engine: TrainingEngine, checkpoints: CheckpointManager,
                    step_dir: Path) -> TrainingPosition:
    """Load ``step_dir`` as saved, or resharded to this run's layout (``checkpoints.layout``)."""
    from lnstrain.checkpoint.reshard import load_resharded, needs_resharding, reshard_problems

    checkpoints.check_same_data(step_dir)
    if not needs_resharding(step_dir, checkpoints.layout):
        return checkpoints.load(engine.engine, step_dir)
    fresh_optimizer = config.checkpoint.reshard_with_fresh_optimizer
    problems = reshard_problems(step_dir, checkpoints.layout, fresh_optimizer)
    if problems:
        raise _cannot_resume(problems)
    position = load_resharded(engine, step_dir, require_optimizer_state=not fresh_optimizer)
    checkpoints.mark_loaded(read_metadata(step_dir))
    return position
