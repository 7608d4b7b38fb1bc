"""Attention across the context split by all-to-all (DeepSpeed-Ulysses): sequence in, heads out.

Before attention each context rank holds its two chunks of the sequence for all its heads; one
all-to-all over the context group gives it the whole sequence for 1/N of its heads (queries, keys
and values together), in sequence order, so attention is the ordinary causal kernel (SDPA, any
backend) over full sequences; a second all-to-all after it gives every rank its chunks back for all
heads. Backward is the same two exchanges reversed. Needs the query and key/value heads of each
tensor rank divisible by N (``config.feasibility`` refuses the rest); the volume per rank is
independent of N's cost in latency, and unlike the ring nothing is kept but the usual
FlashAttention state of a full sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lnstrain.parallel.context import natural_order

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


def _sequence_to_heads(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """[b, 2c, h, d] (this rank's chunks, all heads) -> [b, S, h / N, d] (the sequence, in order)."""
    size = groups.cp_size
    batch, local, heads, head_dim = x.shape
    send = x.reshape(batch, local, size, heads // size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=groups.cp_group)  # [source rank, b, 2c, h / N, d]
    gathered = received.permute(1, 0, 2, 3, 4).reshape(batch, size * local, heads // size, head_dim)
    return gathered.index_select(1, natural_order(size, local, x.device))


def _heads_to_sequence(y: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """The inverse of ``_sequence_to_heads``: [b, S, h / N, d] -> [b, 2c, h, d]."""
    size = groups.cp_size
    batch, seq, heads_here, head_dim = y.shape
    local = seq // size
    by_rank = torch.empty_like(y)
    by_rank.index_copy_(1, natural_order(size, local, y.device), y)  # back to ranks' chunk order
    send = by_rank.reshape(batch, size, local, heads_here, head_dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=groups.cp_group)  # [head group, b, 2c, h / N, d]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, local, size * heads_here, head_dim)


class _AllToAll(torch.autograd.Function):
    """``_sequence_to_heads`` (``to_heads``) or ``_heads_to_sequence`` forward, the other one backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: ParallelGroups, to_heads: bool) -> torch.Tensor:
        ctx.groups, ctx.to_heads = groups, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_sequence if ctx.to_heads else _sequence_to_heads)(grad.contiguous(), ctx.groups), None, None


def sequence_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      groups: ParallelGroups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's chunks of q, k, v ([b, 2c, heads, d]) -> the whole sequence for 1/N of the heads of
    each, in one all-to-all. Collective over the context group."""
    size = groups.cp_size
    batch, local, _, head_dim = q.shape
    parts = [t.reshape(batch, local, size, t.shape[2] // size, head_dim) for t in (q, k, v)]
    widths = [part.shape[3] for part in parts]
    joined = torch.cat(parts, dim=3).reshape(batch, local, size * sum(widths), head_dim)
    gathered = _AllToAll.apply(joined, groups, True)
    return tuple(gathered.split(widths, dim=2))  # type: ignore[return-value]


def heads_to_sequence(out: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Attention's output for the whole sequence and 1/N of the heads ([b, S, h / N, d]) -> this rank's
    chunks for all heads ([b, 2c, h, d]). Collective over the context group."""
    return _AllToAll.apply(out, groups, False)
