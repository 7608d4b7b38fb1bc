"""Tensor- and sequence-parallel communication as tiny autograd functions (Megatron style).

Each function is the identity when tensor parallelism is 1. "Region" means the
tensor-parallel part of a layer: column-parallel in, row-parallel out. Activations are
[batch, seq, hidden]; sequence parallelism shards dim 1.

Collectives are looked up on `torch.distributed` at call time (tests count them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups

SEQUENCE_DIM = 1


def _all_reduce(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=groups.tp_group)
    return x


def _split(x: torch.Tensor, dim: int, groups: ParallelGroups) -> torch.Tensor:
    if x.shape[dim] % groups.tp_size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={groups.tp_size}")
    return x.chunk(groups.tp_size, dim=dim)[groups.tp_rank].contiguous()


def _all_gather(x: torch.Tensor, dim: int, groups: ParallelGroups) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((groups.tp_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=groups.tp_group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, groups: ParallelGroups) -> torch.Tensor:
    if x.shape[dim] % groups.tp_size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by tp={groups.tp_size}")
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // groups.tp_size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=groups.tp_group)
    return out.movedim(0, dim).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.groups), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        return _all_reduce(x, groups)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _split(x, -1, groups)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, grad.dim() - 1, ctx.groups), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _all_gather(x, x.dim() - 1, groups)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.groups), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _split(x, SEQUENCE_DIM, groups)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQUENCE_DIM, ctx.groups), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather the sequence; the consumer is tensor-parallel, so gradients are partial
    sums and go back through a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _all_gather(x, SEQUENCE_DIM, groups)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQUENCE_DIM, ctx.groups), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _reduce_scatter(x, SEQUENCE_DIM, groups)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQUENCE_DIM, ctx.groups), None


class _SumGradientsOverTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        return (None, *(r.view_as(g) for r, g in zip(flat.split([g.numel() for g in grads]), grads)))


class _LinearSummingReplicaGrads(torch.autograd.Function):
    """y = x W^T; backward sums the weight gradient's rows in each (rows, group) over that group."""

    @staticmethod
    def forward(ctx, x, weight, replica_rows):
        ctx.save_for_backward(x, weight)
        ctx.replica_rows = replica_rows
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        for rows, group in ctx.replica_rows:
            dist.all_reduce(grad_weight[rows], group=group)  # a block of rows is contiguous: reduced in place
        return grad_x, grad_weight, None


def _apply(function: type[torch.autograd.Function], x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    return x if groups.tp_size == 1 else function.apply(x, groups)


def copy_to_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return _apply(_CopyToTP, x, groups)


def reduce_from_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """All-reduce forward; identity backward."""
    return _apply(_ReduceFromTP, x, groups)


def scatter_to_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather backward."""
    return _apply(_ScatterToTP, x, groups)


def gather_from_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """All-gather the last dim forward; keep this rank's slice backward."""
    return _apply(_GatherFromTP, x, groups)


def scatter_to_sequence_parallel(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Keep this rank's sequence shard forward; all-gather backward."""
    return _apply(_ScatterToSequenceParallel, x, groups)


def gather_from_sequence_parallel(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """All-gather the sequence forward; reduce-scatter backward."""
    return _apply(_GatherFromSequenceParallel, x, groups)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather backward."""
    return _apply(_ReduceScatterToSequenceParallel, x, groups)


def enter_tp_region(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Make the full activation every column-parallel layer needs from the replicated
    (or, under sequence parallelism, sequence-sharded) hidden states."""
    return gather_from_sequence_parallel(x, groups) if groups.sequence_parallel else copy_to_tp(x, groups)


def exit_tp_region(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs into replicated (or sequence-sharded) hidden states."""
    return reduce_scatter_to_sequence_parallel(x, groups) if groups.sequence_parallel else reduce_from_tp(x, groups)


def sum_gradients_over_tp(tensors: Sequence[torch.Tensor], groups: ParallelGroups) -> tuple[torch.Tensor, ...]:
    """The tensors unchanged forward; backward sums all their gradients over the tensor group in one
    all-reduce. For replicated parameters used on sequence shards: apply where they are used."""
    if groups.tp_size == 1 or not tensors:
        return tuple(tensors)
    return _SumGradientsOverTP.apply(groups.tp_group, *tensors)


def linear_summing_replica_grads(x: torch.Tensor, weight: torch.Tensor,
                                 replica_rows: Sequence[tuple[slice, Any]]) -> torch.Tensor:
    """``F.linear(x, weight)`` whose weight gradient has each block of ``rows`` summed over ``group``
    (the ranks holding copies of those rows), for ``(rows, group)`` in ``replica_rows``."""
    return _LinearSummingReplicaGrads.apply(x, weight, tuple(replica_rows))
