"""Global gradient-norm clipping for the one path where DeepSpeed gets it wrong: fp32 without ZeRO.

DeepSpeed's fp32, ZeRO-0 path (``clip_grad_norm_``) counts a replicated parameter only on model
rank 0 of the pipe × tensor group, so with pipelines it drops the norms, biases and other
replicated parameters of every stage but the first, and it never reports the norm. lnstrain turns
DeepSpeed's clipping off there and clips in an optimizer step pre-hook instead (the gradients are
already averaged over data-parallel ranks when the optimizer steps). Its ZeRO and bf16/fp16
optimizers compute the norm correctly and keep clipping.

A parameter's squared norm is counted once per model replica: parameters sharded across tensor
ranks (``tensor_model_parallel``) on every tensor rank, replicated ones on tensor rank 0 only, and
tied pipeline copies (``ds_pipe_replicated``) on their owning stage only.

Norm and clipping run as foreach kernels (``torch._foreach_norm``, ``torch._foreach_mul_``): a few
launches for all gradients instead of two per parameter. The norm is √Σ‖g‖² over the per-gradient fp32
norms, the formula of torch's ``clip_grad_norm_`` and DeepSpeed; the loop it replaced summed squares, which
agrees to fp32 rounding (relative 1e-6), and the clipped gradients are the same products for the same
norm (tests/training/test_grad_clip.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lnstrain.parallel.groups import collective_device


def counts_on_this_rank(param: torch.Tensor, tp_rank: int) -> bool:
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return tp_rank == 0 or bool(getattr(param, "tensor_model_parallel", False))


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups a foreach kernel takes in one go (one device and dtype each), in first-seen order."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """Σ‖t‖² over ``tensors`` in fp32 (each norm in fp32, by foreach kernels), on the first one's device;
    None for no tensors."""
    if not tensors:
        return None
    norms = [norm for group in _by_device_and_dtype(tensors)
             for norm in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
    return torch.stack([norm.to(tensors[0].device) for norm in norms]).pow(2).sum()


def scale_(tensors: list[torch.Tensor], coefficient: float) -> None:
    """Multiply every tensor in place by ``coefficient`` (foreach kernels)."""
    for group in _by_device_and_dtype(tensors):
        torch._foreach_mul_(group, coefficient)


def global_grad_norm(params: list[torch.Tensor], tp_rank: int, model_parallel_group: Any) -> float:
    """L2 norm of the whole model's gradient (every stage and tensor shard) from this rank's part."""
    total = sum_of_squares([p.grad.detach() for p in params if p.grad is not None and counts_on_this_rank(p, tp_rank)])
    reduced = model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1
    if total is None:  # a rank with nothing to count still joins the all-reduce, with a tensor its backend takes
        total = torch.zeros((), device=collective_device(model_parallel_group) if reduced else "cpu")
    total = total.reshape(1).to(torch.float64)
    if reduced:
        dist.all_reduce(total, group=model_parallel_group)
    return math.sqrt(total.item())


class GradClipHook:
    """Optimizer step pre-hook: measure the global gradient norm, clip to ``max_norm`` (0: measure only)."""

    def __init__(self, params: list[torch.Tensor], max_norm: float, tp_rank: int, model_parallel_group: Any):
        self.params = params
        self.max_norm = max_norm
        self.tp_rank = tp_rank
        self.model_parallel_group = model_parallel_group
        self.last_norm: float | None = None

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        norm = global_grad_norm(self.params, self.tp_rank, self.model_parallel_group)
        self.last_norm = norm
        if self.max_norm > 0 and math.isfinite(norm) and norm > self.max_norm:
            scale_([param.grad for param in self.params if param.grad is not None], self.max_norm / (norm + 1e-6))
