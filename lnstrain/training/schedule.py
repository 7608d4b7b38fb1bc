"""Learning-rate schedule: linear warmup from 0, then cosine, linear or constant decay.

``lr_at`` is the whole schedule as a pure function (tests and plots use it); ``build_scheduler``
wraps it in a ``LambdaLR`` that DeepSpeed steps once per optimizer step and saves in checkpoints.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

Decay = Literal["cosine", "linear", "constant"]


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
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        return min_lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"optim.decay must be 'cosine', 'linear' or 'constant' (got {decay!r})")


def _multiplier(step: int, **schedule) -> float:
    return lr_at(step, **schedule) / schedule["lr"]


def build_scheduler(optimizer: torch.optim.Optimizer, *, lr: float, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1, decay: Decay = "cosine") -> LambdaLR:
    """A ``LambdaLR`` following ``lr_at``; every param group's initial lr must be ``lr``.

    The lambda is a ``functools.partial`` of a module-level function, so the scheduler's state
    dict (which DeepSpeed checkpoints) holds only the step count, never a closure.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
        group["initial_lr"] = lr
    multiplier = partial(_multiplier, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                         min_lr_ratio=min_lr_ratio, decay=decay)
    return LambdaLR(optimizer, multiplier)
