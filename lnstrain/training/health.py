"""Non-finite steps, loss spikes and skipped data: what keeps one bad batch from ruining a run.

``NonFiniteGuard`` notices non-finite values in the model's output (logits on the last pipeline
stage, activations elsewhere) during a step, and all ranks agree on it in one all-reduce right
before the optimizer step; for a bad step it empties the gradients handed to the torch optimizer,
which then leaves weights and Adam state untouched. fp16 runs are left to DeepSpeed's loss scaler,
which already skips overflowing steps. A non-finite loss with finite outputs (possible only with
a broken loss) is noticed after the step, from the loss every rank returns.

Skipped data keeps Contract 4's "step s trains on global batch s": a step whose batch is skipped
(``train.skip_sample_ranges``, or rolled back) trains on nothing, and the schedule still moves on.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


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
        if not self.skip_update:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # torch's Adam/AdamW leave parameters without gradients untouched

    def end_step(self) -> bool:
        """Whether the step just taken was declared bad (and its update dropped); resets for the next."""
        bad, self.skip_update = self.skip_update, False
        return bad

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


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
