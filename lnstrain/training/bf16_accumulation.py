"""One kernel, not two, for each bf16 gradient DeepSpeed's ``BF16_Optimizer`` adds into its fp32 buffer.

DeepSpeed adds a parameter's bf16 gradient to the fp32 accumulation buffer as ``fp32.add_(bf16.to(fp32))``:
a cast into a new fp32 tensor, then the add, once per parameter and micro-batch (147 × 8 times a step in
the 1B training layout; about 50 ms of the H100's 1.40 s step, docs/performance.md). ``add_`` given the
bf16 tensor itself promotes each element to fp32 inside the one kernel: the same sums (bf16 → fp32 is
exact), without the temporary. ``fuse_gradient_cast`` makes one optimizer instance do that.
"""

from __future__ import annotations

import inspect
import logging
import types

import torch

logger = logging.getLogger(__name__)

_DEEPSPEED_PARAMETERS = ("lp", "group_idx", "param_idx", "clear_lp_grads")
"""The signature of ``BF16_Optimizer._update_hp_grad`` this replacement keeps (DeepSpeed 0.14 to 0.19)."""


@torch.no_grad()
def _add_bf16_gradient(optimizer, lp: torch.nn.Parameter, group_idx: int, param_idx: int,
                       clear_lp_grads: bool) -> None:
    if lp.grad is None:
        return
    fp32_gradient = optimizer.fp32_groups_gradients[group_idx][param_idx]
    fp32_gradient.add_(lp.grad.view(fp32_gradient.shape))
    lp._hp_grad = fp32_gradient
    optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
    if clear_lp_grads:
        lp.grad.zero_()


def fuse_gradient_cast(optimizer: object) -> bool:
    """Replace ``optimizer``'s gradient add with the one-kernel form when it is a ``BF16_Optimizer`` whose
    method has the signature and state this knows (and no expert-parallel folding, which it skips);
    whether it did. Nothing else about the optimizer changes."""
    method = getattr(type(optimizer), "_update_hp_grad", None)
    if (type(optimizer).__name__ != "BF16_Optimizer" or method is None
            or tuple(inspect.signature(method).parameters)[1:] != _DEEPSPEED_PARAMETERS
            or not hasattr(optimizer, "fp32_groups_gradients") or not hasattr(optimizer, "fp32_groups_has_gradients")
            or getattr(optimizer, "autoep_folding_tp_group", None) is not None):
        logger.debug("keeping %s's own gradient add", type(optimizer).__name__)
        return False
    optimizer._update_hp_grad = types.MethodType(_add_bf16_gradient, optimizer)
    return True
