"""Where a run starts: its own checkpoint (resharded when the parallel layout changed), the weights
named by ``checkpoint.init_from``, or step 0.

The checkpoint ``checkpoint.resume`` names is verified first (``CheckpointManager.verified_checkpoint``,
``lnstrain.checkpoint.verifier``); when it does not verify, ``auto`` and a checkpoint directory fall
back to the newest older checkpoint that does, while an explicit ``global_step<N>`` is refused. Every
refusal here is reached by every rank alike (``CheckpointError.agreed``). A checkpoint trained with
another learning-rate schedule than this config's goes on as ``optim.schedule_change`` says, with one
warning (``follow_schedule_on_resume``, ``lnstrain.training.schedule``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.locations import resolve_resume
from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition
from lnstrain.checkpoint.metadata import METADATA_FILE, read_metadata, step_of
from lnstrain.checkpoint.verifier import nothing_verifies
from lnstrain.config.run_config import Config
from lnstrain.training.schedule import LrSchedule, schedule_keys, schedule_on_resume

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

logger = logging.getLogger(__name__)


def _cannot_resume(problems: list[str]) -> CheckpointError:
    return CheckpointError("cannot resume:\n  - " + "\n  - ".join(problems), agreed=True)


def data_reach_problems(config: Config, step_dir: Path, samples: int) -> list[str]:
    """Where the rest of the run from ``step_dir``'s position needs samples beyond the ``samples``
    this run's data serves (``total_steps`` global batches): its position was rewritten consistently
    (the verifier compares it with its own config and DeepSpeed's record, not with this run), or
    ``train.global_batch_size`` grew since. Said before anything is loaded, instead of an index error
    steps later."""
    metadata = read_metadata(step_dir)
    if metadata.step >= config.total_steps:
        return []  # nothing left to train: no sample is read
    needed = metadata.consumed_samples + (config.total_steps - metadata.step) * config.train.global_batch_size
    if needed <= samples:
        return []
    return [f"{step_dir / METADATA_FILE} says {metadata.consumed_samples} samples were consumed by step "
            f"{metadata.step}; the {config.total_steps - metadata.step} steps left of {config.train.global_batch_size} "
            f"samples would read up to sample {needed}, but this run's data serves {samples} ({config.total_steps} "
            "steps of train.global_batch_size): the checkpoint's position was rewritten, or train.global_batch_size "
            "is not the one it was saved with; use another checkpoint (tools/verify_checkpoint.py lists them)"]


def restore_or_start(config: Config, engine: TrainingEngine, checkpoints: CheckpointManager,
                     samples: int | None = None) -> tuple[TrainingPosition, Path | None]:
    """Load the checkpoint ``checkpoint.resume`` names into ``engine`` and return its position and
    directory; with none to resume, initialise from ``checkpoint.init_from`` when given and return
    step 0 and None. ``samples``: how many training samples this run's data serves (its position must
    leave room for the rest of the run). Collective: every rank calls it."""
    step_dir, problems = resolve_resume(config.checkpoint.resume, config.checkpoint_dir)
    if problems:
        raise _cannot_resume(problems)
    if step_dir is None:
        if config.checkpoint.init_from:
            from lnstrain.checkpoint.reshard import initialize_from

            logger.info("initialising the model from %s (checkpoint.init_from)", config.checkpoint.init_from)
            initialize_from(engine, config.checkpoint.init_from, config.checkpoint.init_from_unfold_lns,
                            checkpoints.trust)
        return TrainingPosition(), None
    named = step_dir
    explicit_step = step_of(Path(config.checkpoint.resume)) is not None
    logger.info("verifying checkpoint %s%s", step_dir, "" if config.checkpoint.verify_checksums else
                " (sizes and pickles only: checkpoint.verify_checksums is false)")
    step_dir, skipped = checkpoints.verified_checkpoint(step_dir, fall_back=not explicit_step)
    if step_dir is None:
        raise CheckpointError(nothing_verifies(named, explicit_step, skipped), agreed=True)
    if step_dir != named:  # the pre-launch check compared the model with the one named, not this one
        from lnstrain.training.preflight import model_mismatch_problems

        problems = model_mismatch_problems(config, step_dir)
        if problems:
            raise _cannot_resume([f"{named} failed verification, and the newest older checkpoint that verifies "
                                  f"was saved with another model:", *problems])
    if samples is not None and (problems := data_reach_problems(config, step_dir, samples)):
        raise _cannot_resume(problems)  # every rank built the same data: agreed
    logger.info("loading checkpoint %s", step_dir)
    position = load_checkpoint(config, engine, checkpoints, step_dir)
    follow_schedule_on_resume(config, engine, step_dir, position.step)
    return position, step_dir


def saved_schedules(step_dir: Path) -> tuple[LrSchedule, LrSchedule]:
    """(the schedule the checkpoint's config asked for, the one it followed), from its metadata; a
    checkpoint from before they were recorded followed its config's."""
    recorded = read_metadata(step_dir).lr_schedule
    if recorded is not None:
        source = f"{step_dir}/lnstrain_metadata.json lr_schedule"
        return (LrSchedule.from_dict(recorded["configured"], source),
                LrSchedule.from_dict(recorded["in_effect"], source))
    from lnstrain.checkpoint.layouts import read_step_config

    configured = LrSchedule.from_config(read_step_config(step_dir))
    return configured, configured


def follow_schedule_on_resume(config: Config, engine: TrainingEngine, step_dir: Path, step: int) -> None:
    """Go on with the checkpoint's learning-rate schedule, or, when this config asks for another one, with
    what ``optim.schedule_change`` says; rank 0 logs one warning naming the change and the learning
    rate before and after (``lnstrain.training.schedule``). Every rank decides alike from the same files."""
    try:
        saved_configured, saved_in_effect = saved_schedules(step_dir)
    except ValueError as error:
        raise _cannot_resume([f"the learning-rate schedule of {step_dir} cannot be read: {error}"]) from None
    schedule, warning = schedule_on_resume(LrSchedule.from_config(config), saved_configured, saved_in_effect, step,
                                           config.optim.schedule_change, step_dir.name, schedule_keys(config))
    if warning and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("%s", warning)
    engine.follow_lr_schedule(schedule)  # the loaded state has the checkpoint's rates: from here on, this schedule's


def load_checkpoint(config: Config, engine: TrainingEngine, checkpoints: CheckpointManager,
                    step_dir: Path) -> TrainingPosition:
    """Load ``step_dir`` as saved, or resharded to this run's layout (``checkpoints.layout``)."""
    from lnstrain.checkpoint.reshard import load_resharded, needs_resharding, reshard_problems

    checkpoints.check_same_data(step_dir)
    if not needs_resharding(step_dir, checkpoints.layout):
        return checkpoints.load(engine, step_dir)
    fresh_optimizer = config.checkpoint.reshard_with_fresh_optimizer
    problems = reshard_problems(step_dir, checkpoints.layout, fresh_optimizer)
    if problems:
        raise _cannot_resume(problems)
    position = load_resharded(engine, step_dir, require_optimizer_state=not fresh_optimizer,
                              allow_pickle=config.checkpoint.allow_pickle)
    checkpoints.mark_loaded(read_metadata(step_dir))
    return position
