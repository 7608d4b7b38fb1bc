"""Replicated parameters that act on sequence shards: their gradients, summed inside autograd.

Under sequence parallelism the norms (and LayerScale gains) are replicated on every tensor rank
but each rank applies them to its own sequence shard, so each rank's gradient is a partial sum.
`sequence_parallel_params` hands such modules stand-ins for their parameters (the same values)
whose backward sums all their gradients over the tensor group in one all-reduce: a block calls it
once per forward for all its norms, so backward issues one extra all-reduce per layer, and the
gradient is complete before DeepSpeed's hooks (ZeRO, pipeline, bf16) ever see it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from lnstrain.parallel.mappings import sum_gradients_over_tp

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


def sums_sequence_parallel_grads(groups: ParallelGroups) -> bool:
    return groups.sequence_parallel and groups.tp_size > 1


def sequence_parallel_params(modules: Mapping[str, nn.Module | None],
                             groups: ParallelGroups) -> dict[str, tuple[torch.Tensor, ...]]:
    """{name: stand-ins for the module's parameters, in ``parameters()`` order}, for every module
    with parameters; pass them as ``module(x, *stand_ins)``. Empty without sequence parallelism."""
    if not sums_sequence_parallel_grads(groups):
        return {}
    # Looked up by attribute, not module.parameters(): ZeRO-3 gathers a partitioned parameter on
    # attribute access during forward (its "external parameter" discovery), not on iteration.
    owned = {name: [module.get_parameter(param) for param, _ in module.named_parameters()]
             for name, module in modules.items() if module is not None}
    owned = {name: params for name, params in owned.items() if params}
    stand_ins = iter(sum_gradients_over_tp([p for params in owned.values() for p in params], groups))
    return {name: tuple(next(stand_ins) for _ in params) for name, params in owned.items()}
