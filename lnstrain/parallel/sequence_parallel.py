"""Gradients that are partial sums across the tensor-parallel group.

Two kinds of parameter are replicated on every tensor-parallel rank but see only part of
the data, so their gradients must be summed over the group after backward:
- under sequence parallelism, the norms' weights (and LayerScale gains), which act on
  sequence shards; they are marked `param.sequence_parallel = True`;
- replicated key/value heads (fewer KV heads than ranks), which each rank uses for its own
  query heads only (`ColumnParallelLinear.allreduce_replicated_grads`).
The trainer calls `allreduce_sequence_parallel_grads(model, groups)` after every backward
(before clipping and the optimizer step). It is a no-op at tensor parallelism 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from lnstrain.parallel.layers import ColumnParallelLinear

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


def mark_sequence_parallel(module: nn.Module, groups: ParallelGroups) -> None:
    """Mark every parameter of `module` (a norm, a LayerScale) as acting on sequence shards."""
    if groups.sequence_parallel and groups.tp_size > 1:
        for param in module.parameters():
            param.sequence_parallel = True


def allreduce_sequence_parallel_grads(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum, over the tensor-parallel group, every gradient that is a partial sum (see above)."""
    if groups.tp_size == 1:
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=groups.tp_group)
        for grad, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(reduced.view_as(grad))
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.allreduce_replicated_grads()
