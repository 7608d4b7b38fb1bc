"""Tensor- and sequence-parallel communication as tiny autograd functions (Megatron style).

Each function is the identity when tensor parallelism is 1. "Region" means the
tensor-parallel part of a layer: column-parallel in, row-parallel out. Activations are
[batch, seq, hidden]; sequence parallelism shards dim 1.

Collectives are looked up on `torch.distributed` at call time (tests count them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

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
