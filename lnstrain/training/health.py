"""Non-finite steps, loss spikes and skipped data: what keeps one bad batch from ruining a run.

``NonFiniteGuard`` notices non-finite values in the model's output (logits on the last pipeline
stage, activations elsewhere) during a step, and all ranks agree on it in one all-reduce right
before the optimizer step; for a bad step it empties the gradients handed to the torch optimizer,
which then leaves weights and Adam state untouched. fp16 runs are left to DeepSpeed's loss scaler,
which already skips overflowing steps.

Non-finite gradients from finite outputs (a non-finite loss, which on a pipeline only the last
stage computes, or a backward that overflows) are caught by the global gradient norm, which every
rank of a model replica shares: DeepSpeed's ZeRO and bf16 optimizers skip such a step themselves,
and ``NonFiniteGradientSkip`` does the same where lnstrain clips (fp32 without ZeRO). The loss every
rank returns then tells the trainer the step was non-finite.

Skipped data keeps "step s trains on global batch s", which a resume relies on (docs/architecture.md,
"Checkpoint format"): a step whose batch is skipped (``train.skip_sample_ranges``, or rolled back)
trains on nothing, and the schedule still moves on.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Leave the optimizer's parameters without gradients: torch's Adam and AdamW then leave those
    parameters and their state (moments, step count) untouched."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


class NonFiniteGuard:
    """Watches a module's outputs; ``decide()`` (collective, before the optimizer step) says whether
    this step is bad anywhere, and a bad step's update is not applied.

    Args:
        module: this rank's model (its forward output is checked).
        optimizer: the torch optimizer DeepSpeed drives (its step sees no gradients on a bad step).
        device: where the flag lives for the all-reduce.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.device = torch.device(device)
        self._local_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self.skip_update = False
        self._handles = [module.register_forward_hook(self._check_output),
                         optimizer.register_step_pre_hook(self._drop_gradients)]

    def _check_output(self, _module: Any, _inputs: Any, output: Any) -> None:
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if torch.is_tensor(tensor) and tensor.is_floating_point():
            self._local_bad |= ~torch.isfinite(tensor.detach()).all().to(self.device)

    def begin_step(self) -> None:
        self._local_bad.zero_()  # evaluation forwards in between do not count
        self.skip_update = False

    def decide(self) -> None:
        """Collective: every rank calls it once per step, after backward and before the optimizer."""
        flag = self._local_bad.to(torch.int32).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.skip_update = bool(flag.item())
        self._local_bad.zero_()

    def _drop_gradients(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self.skip_update:
            drop_gradients(optimizer)

    def end_step(self) -> bool:
        """Whether the step just taken was declared bad (and its update dropped); resets for the next."""
        bad, self.skip_update = self.skip_update, False
        return bad

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class NonFiniteGradientSkip:
    """Optimizer step pre-hook, after the hook that measures the global gradient norm: a step whose
    norm is not finite is not applied, as DeepSpeed's own optimizers do it.

    Setting ``optimizer.overflow`` is DeepSpeed's signal from an optimizer that it skipped the step:
    DeepSpeed then reports the step as not applied and leaves the learning-rate schedule where it
    is, exactly as after a ZeRO or bf16 optimizer's skipped step. The norm is reduced over every
    pipeline stage and tensor rank, and data-parallel ranks hold the same gradients, so every rank
    skips the same steps.

    Args:
        global_norm: the norm measured for this step (None: not measured, the step goes ahead).
    """

    def __init__(self, global_norm: Callable[[], float | None]) -> None:
        self.global_norm = global_norm

    def __call__(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        norm = self.global_norm()
        optimizer.overflow = norm is not None and not math.isfinite(norm)
        if optimizer.overflow:
            logger.warning("global gradient norm is %s: this step's update is not applied", norm)
            drop_gradients(optimizer)


class LossSpikeDetector:
    """A loss more than ``zscore`` standard deviations above the mean of the last ``window`` finite
    losses is a spike (reported, not acted on)."""

    def __init__(self, window: int, zscore: float) -> None:
        self.zscore = zscore
        self.recent: deque[float] = deque(maxlen=max(window, 1))
        self.enabled = window > 0

    def observe(self, loss: float) -> float | None:
        """The loss's z-score when it is a spike, else None. Non-finite losses are not recorded."""
        if not self.enabled or not math.isfinite(loss):
            return None
        spike = None
        if len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / len(self.recent))
            score = (loss - mean) / max(std, 1e-12)
            if score > self.zscore:
                spike = score
        self.recent.append(loss)
        return spike
