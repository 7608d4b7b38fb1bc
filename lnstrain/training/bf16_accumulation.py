"""DeepSpeed's ``BF16_Optimizer`` gradient add (each bf16 gradient into its fp32 accumulation buffer) at
memory speed, with few launches.

DeepSpeed adds a parameter's bf16 gradient as ``fp32.add_(bf16.to(fp32))``: a cast into a new fp32 tensor,
then an add on torch's unvectorised mixed-dtype path, once per parameter and micro-batch (147 × 8 times a
step in the 1B training layout, from per-parameter hooks with ``bf16.immediate_grad_update``;
docs/performance.md). ``FusedGradientAdd`` replaces that on one optimizer instance:

* where the Triton kernel runs and has given torch's sums on the device (``accumulation_kernel.usable``), the hooks
  collect (fp32 buffer, bf16 gradient) pairs and one launch of ``accumulation_kernel.add_into_fp32`` adds a
  bucket of them (``BUCKET_ELEMENTS``, 128 MiB of bf16 gradients held at most) with 16-byte accesses; the
  rest is added when DeepSpeed's backward epilogue asks for the gradients (``update_hp_grads``), before any
  reduction, norm or step reads them. The 1B model's 1,176 launches a step become about 8 × 22;
* elsewhere (the CPU), each gradient is added at once with ``add_`` given the bf16 tensor itself, which
  promotes inside one kernel and keeps no temporary.

Both give DeepSpeed's sums bit for bit (bf16 → fp32 is exact and each element is one rounded fp32
addition). Clipping, too, works on the buffers rather than on each parameter's view of them: DeepSpeed
multiplies the list ``get_grads_for_norm(for_clipping=True)`` gives it one tensor at a time, and that list
is now each group's flat fp32 buffer (a parameter without a gradient holds zeros there, its padding too),
two products a step instead of 147, the same numbers. ``set_enabled(False)`` restores DeepSpeed's own methods on the instance (the benchmark's switch,
``lnstrain.benchmark.switches``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from lnstrain.training import accumulation_kernel

logger = logging.getLogger(__name__)

_DEEPSPEED_PARAMETERS = ("lp", "group_idx", "param_idx", "clear_lp_grads")
"""The signature of ``BF16_Optimizer._update_hp_grad`` this replacement keeps (DeepSpeed 0.14 to 0.19)."""
_REPLACED = ("_update_hp_grad", "update_hp_grads", "get_grads_for_norm")
BUCKET_ELEMENTS = 1 << 26
"""Gradient elements collected before a launch: 128 MiB of bf16 gradients kept alive at most."""


class FusedGradientAdd:
    """The gradient add of one ``BF16_Optimizer``, installed on the instance (``install``)."""

    def __init__(self, optimizer: Any, bucket_elements: int = BUCKET_ELEMENTS) -> None:
        self.optimizer = optimizer
        self.bucket_elements = bucket_elements
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pending_elements = 0
        self.launches = 0
        """Kernel launches so far (each adds a bucket)."""
        self.enabled = False

    def set_enabled(self, enabled: bool) -> None:
        """Install the fused add on the optimizer instance, or restore DeepSpeed's methods."""
        self.flush()
        for name in _REPLACED:
            if enabled:
                setattr(self.optimizer, name, getattr(self, name))
            else:
                self.optimizer.__dict__.pop(name, None)
        self.enabled = enabled

    @torch.no_grad()
    def _update_hp_grad(self, lp: torch.nn.Parameter, group_idx: int, param_idx: int, clear_lp_grads: bool) -> None:
        if lp.grad is None:
            return
        optimizer = self.optimizer
        fp32_gradient = optimizer.fp32_groups_gradients[group_idx][param_idx]
        gradient = lp.grad.view(fp32_gradient.shape)
        lp._hp_grad = fp32_gradient
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if accumulation_kernel.usable(fp32_gradient, gradient):
            self.pending.append((fp32_gradient, gradient))
            self.pending_elements += gradient.numel()
            if self.pending_elements >= self.bucket_elements or clear_lp_grads:
                self.flush()
        else:
            fp32_gradient.add_(gradient)
        if clear_lp_grads:
            lp.grad.zero_()

    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        """DeepSpeed's own (which adds nothing with ``immediate_grad_update``), then what is still collected."""
        type(self.optimizer).update_hp_grads(self.optimizer, clear_lp_grads=clear_lp_grads)
        self.flush()

    def get_grads_for_norm(self, for_clipping: bool = False):
        """DeepSpeed's lists for the norm; for clipping, the flat fp32 buffers that hold every gradient."""
        if for_clipping:
            return list(self.optimizer.fp32_groups_gradients_flat)
        return type(self.optimizer).get_grads_for_norm(self.optimizer, for_clipping=False)

    @torch.no_grad()
    def flush(self) -> None:
        """Add every collected gradient into its fp32 buffer (one launch) and let go of them."""
        if not self.pending:
            return
        pending, self.pending, self.pending_elements = self.pending, [], 0
        accumulation_kernel.add_into_fp32(pending)
        self.launches += 1


def install(optimizer: object) -> FusedGradientAdd | None:
    """Install ``FusedGradientAdd`` on ``optimizer`` when it is a ``BF16_Optimizer`` whose methods have the
    signature and state this knows (and no expert-parallel folding, which it skips); None otherwise, and
    nothing about the optimizer changes."""
    method = getattr(type(optimizer), "_update_hp_grad", None)
    if (type(optimizer).__name__ != "BF16_Optimizer" or method is None
            or tuple(inspect.signature(method).parameters)[1:] != _DEEPSPEED_PARAMETERS
            or not all(callable(getattr(type(optimizer), name, None)) for name in _REPLACED)
            or not hasattr(optimizer, "fp32_groups_gradients_flat") or getattr(optimizer, "has_moe_layers", False)
            or not hasattr(optimizer, "fp32_groups_gradients") or not hasattr(optimizer, "fp32_groups_has_gradients")
            or getattr(optimizer, "autoep_folding_tp_group", None) is not None):
        logger.debug("keeping %s's own gradient add", type(optimizer).__name__)
        return None
    fused = FusedGradientAdd(optimizer)
    fused.set_enabled(True)
    return fused


def is_installed(optimizer: object) -> bool:
    """Whether ``optimizer``'s gradient add is a ``FusedGradientAdd``'s."""
    method = getattr(optimizer, "_update_hp_grad", None)
    return isinstance(getattr(method, "__self__", None), FusedGradientAdd)
