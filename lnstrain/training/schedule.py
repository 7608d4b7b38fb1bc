"""Learning-rate schedule: linear warmup from 0, then cosine, linear or constant decay; and what a
resume does when the schedule changed since the checkpoint (``optim.schedule_change``).

``lr_at`` is the whole schedule as a pure function (tests and plots use it); ``LrSchedule`` is one
run's schedule as data, ``build_scheduler`` wraps it in a ``LambdaLR`` that DeepSpeed steps once per
optimizer step and saves in checkpoints (its step count: the schedule itself goes into the
checkpoint's metadata, ``lr_schedule``).

A resumed run whose config gives another schedule than the checkpoint was trained with (a longer
``train.steps``, another ``optim.lr``, warmup, decay or ``min_lr_ratio``) goes on as
``optim.schedule_change`` says, with one warning naming what changed and the learning rate before and
after (``schedule_on_resume``):

- ``decay`` (the default): from the learning rate the checkpoint's schedule gives for the next step,
  decay with ``optim.decay``'s shape to ``optim.lr * optim.min_lr_ratio`` at the new last step; no
  jump, and no warmup again (a WSD-style cooldown when the run was at its peak);
- ``stretch``: the new schedule as if the run had always had it (torchtitan's behaviour, Megatron-LM's
  ``--override-opt_param-scheduler``): the learning rate jumps to where the new schedule is;
- ``keep``: the checkpoint's schedule as it was (Megatron-LM's ``--use-checkpoint-opt_param-scheduler``);
  past its last step the learning rate stays at its minimum.

With nothing changed the checkpoint's schedule goes on exactly (bit for bit: the same function), and
a schedule a resume chose is kept by the later resumes of the same config.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

Decay = Literal["cosine", "linear", "constant"]
ScheduleChange = Literal["decay", "stretch", "keep"]
SCHEDULE_CHANGES = ("decay", "stretch", "keep")


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1,
          decay: Decay = "cosine") -> float:
    """The learning rate of optimizer step ``step`` (0-based: the first update uses ``lr_at(0)``).

    Warmup rises linearly from ``lr / warmup_steps`` at step 0 to ``lr`` at step ``warmup_steps - 1``
    (so no update is wasted at lr 0). Decay then goes from ``lr`` at ``warmup_steps`` to
    ``lr * min_lr_ratio`` at ``total_steps`` and stays there; ``constant`` keeps ``lr``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_ratio
    if decay == "constant":
        return lr
    return _decayed(lr, min_lr, step - warmup_steps, total_steps - warmup_steps, decay)


def _decayed(start: float, end: float, done: int, length: int, decay: Decay) -> float:
    """``done`` steps into a decay of ``length`` steps from ``start`` to ``end`` (``end`` after it)."""
    if length <= 0:
        return end
    progress = min(1.0, done / length)
    if decay == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "linear":
        return start - (start - end) * progress
    if decay == "constant":
        return start
    raise ValueError(f"optim.decay must be 'cosine', 'linear' or 'constant' (got {decay!r})")


@dataclass(frozen=True)
class LrSchedule:
    """One run's learning-rate schedule, as data (JSON in a checkpoint's metadata).

    Attributes:
        lr, warmup_steps, total_steps, min_lr_ratio, decay: as ``lr_at`` takes them.
        resumed_at, resumed_lr: a resume's decay (``optim.schedule_change: decay``): from step
            ``resumed_at`` (0-based, the first step after the checkpoint) at ``resumed_lr``, ``decay``'s
            shape to ``lr * min_lr_ratio`` at ``total_steps``; None: the plain schedule.
    """

    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1
    decay: Decay = "cosine"
    resumed_at: int | None = None
    resumed_lr: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> "LrSchedule":
        """The schedule a run config asks for (``optim`` and the run's length)."""
        return cls(lr=config.optim.lr, warmup_steps=config.warmup_steps, total_steps=config.total_steps,
                   min_lr_ratio=config.optim.min_lr_ratio, decay=config.optim.decay)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if self.resumed_at is None or step < self.resumed_at:
            return lr_at(step, lr=self.lr, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                         min_lr_ratio=self.min_lr_ratio, decay=self.decay)
        return _decayed(self.resumed_lr, self.lr * self.min_lr_ratio, step - self.resumed_at,
                        self.total_steps - self.resumed_at, self.decay)

    def plain(self) -> "LrSchedule":
        """The schedule without a resume's decay: what a config says."""
        return dataclasses.replace(self, resumed_at=None, resumed_lr=None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str) -> "LrSchedule":
        """Read back ``to_dict``'s output; ValueError naming ``source`` when it is not one."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not {"lr", "warmup_steps", "total_steps"} <= data.keys() <= names:
            raise ValueError(f"{source}: not a learning-rate schedule ({str(data)[:120]})")
        schedule = cls(**data)
        numbers_ok = (all(isinstance(getattr(schedule, n), (int, float)) for n in ("lr", "min_lr_ratio"))
                      and all(type(getattr(schedule, n)) is int for n in ("warmup_steps", "total_steps"))
                      and schedule.decay in ("cosine", "linear", "constant")
                      and (schedule.resumed_at is None) == (schedule.resumed_lr is None))
        if not numbers_ok:
            raise ValueError(f"{source}: not a learning-rate schedule ({str(data)[:120]})")
        return schedule


def _multiplier(step: int, schedule: LrSchedule) -> float:
    return schedule.lr_at(step) / schedule.lr


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LrSchedule) -> LambdaLR:
    """A ``LambdaLR`` following ``schedule``; every param group's initial lr becomes its peak ``lr``.

    The lambda is a ``functools.partial`` of a module-level function, so the scheduler's state
    dict (which DeepSpeed checkpoints) holds only the step count, never a closure.
    """
    for group in optimizer.param_groups:
        group["lr"] = schedule.lr
        group["initial_lr"] = schedule.lr
    return LambdaLR(optimizer, partial(_multiplier, schedule=schedule))


def schedule_of(scheduler: LambdaLR) -> LrSchedule:
    """The schedule a ``build_scheduler`` scheduler follows."""
    return scheduler.lr_lambdas[0].keywords["schedule"]


def follow_schedule(scheduler: LambdaLR, schedule: LrSchedule) -> None:
    """Make a loaded ``scheduler`` follow ``schedule`` from its current step on: the next update uses
    ``schedule.lr_at(step)``."""
    multiplier = partial(_multiplier, schedule=schedule)
    scheduler.lr_lambdas = [multiplier for _ in scheduler.optimizer.param_groups]
    scheduler.base_lrs = [schedule.lr for _ in scheduler.optimizer.param_groups]
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = schedule.lr
        group["lr"] = schedule.lr * multiplier(scheduler.last_epoch)  # as LambdaLR computes it
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def schedule_keys(config: Any) -> dict[str, str]:
    """The config keys that set each ``LrSchedule`` field of ``config``, as a warning names them."""
    return {"total_steps": "train.steps" if config.train.steps is not None else "train.tokens (in steps)",
            "lr": "optim.lr", "min_lr_ratio": "optim.min_lr_ratio", "decay": "optim.decay",
            "warmup_steps": ("optim.warmup_steps" if config.optim.warmup_steps is not None
                             else "warmup steps (optim.warmup_fraction of the run)")}


def schedule_on_resume(configured: LrSchedule, saved_configured: LrSchedule, saved_in_effect: LrSchedule,
                       step: int, change: ScheduleChange, checkpoint: str,
                       keys: dict[str, str]) -> tuple[LrSchedule, str | None]:
    """(the schedule a run resumed at ``step`` follows, the warning to log or None).

    ``configured``: what this run's config asks for (``keys``: the config keys that set each field,
    ``schedule_keys``); ``saved_configured``, ``saved_in_effect``: what the config of the checkpoint
    (named ``checkpoint`` in the warning) asked for and what it followed. Unchanged, the checkpoint's
    schedule goes on as it was; changed, ``change`` decides (module docstring).
    """
    if configured == saved_configured.plain():
        return saved_in_effect, None
    before = saved_in_effect.lr_at(step)
    choices = {"decay": dataclasses.replace(configured, resumed_at=step, resumed_lr=before),
               "stretch": configured, "keep": saved_in_effect}
    chosen = choices[change]
    what = ", ".join(f"{key} {getattr(saved_configured, name)} -> {getattr(configured, name)}"
                     for name, key in keys.items() if getattr(saved_configured, name) != getattr(configured, name))
    how = {"decay": f"decays ({configured.decay}) from there to {configured.lr * configured.min_lr_ratio:.2e} at "
                    f"step {configured.total_steps}",
           "stretch": "follows the new schedule as if the run had always had it",
           "keep": f"follows the checkpoint's schedule (its last step {saved_in_effect.total_steps})"}[change]
    others = ", ".join(f"{name}: {choices[name].lr_at(step):.2e}" for name in SCHEDULE_CHANGES if name != change)
    return chosen, (f"the learning-rate schedule changed since {checkpoint} ({what}): with optim.schedule_change "
                    f"{change}, the lr of step {step + 1} is {chosen.lr_at(step):.2e} (the checkpoint's schedule "
                    f"gave {before:.2e}) and {how}; optim.schedule_change {others}")
