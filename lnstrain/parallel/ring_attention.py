"""Exact causal attention over a sequence split across the context group: ring attention.

Rank i holds chunks i and 2N-1-i of the sequence (``parallel.context``). Its queries meet every
rank's keys and values as these are passed around the ring, one rank's block a step: at step s it
holds the block of rank j = i - s (mod N) and sends it on to rank i + 1 while computing with it.
With the load-balanced chunks each step is one of three kinds, all of equal cost after the first:

* s = 0, its own block: causal attention of its 2c queries over its 2c keys (the local positions
  increase, so the causal mask on local indices is the global one);
* j < i: all its queries over the early chunk (j) of the block, no mask (chunk 2N-1-j lies in the future
  of both query chunks);
* j > i: its late chunk's queries (2N-1-i) over the whole block, no mask (the early chunk i sees none of it).

Partial results merge through their log-sum-exp (``attention_blocks``). Backward passes the blocks
around again, with an fp32 accumulator of each block's key/value gradient travelling with it and
arriving at its owner after N steps. Queries, keys, values, the output and the fp32 log-sum-exp are
what is kept for backward, as with FlashAttention. Communication is point-to-point
(``torch.distributed.batch_isend_irecv``, gloo or NCCL), posted before the step's computation so
that it can overlap with it; a peer that dies makes the receive fail at the process group's timeout
(``train.collective_timeout_minutes``) instead of waiting forever.

Forward and backward are torch custom operators (``lnstrain::ring_attention`` and
``lnstrain::ring_attention_backward``, with fake implementations that give the shapes), so that
``torch.compile`` keeps the ring out of its graph as one opaque call while the rest of each layer
compiles, activation checkpointing included: dynamo traces no point-to-point communication (torch 2.11
cannot), and inductor never reorders the exchanges. The operators name the context group by its
registered name (``ProcessGroup.group_name``, as torch's functional collectives do).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from lnstrain.parallel.attention_blocks import (flash_backward, flash_forward, reference_backward, reference_forward,
                                                uses_flash)

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class _Exchange:
    """One send to the next context rank and one receive from the previous one, in flight."""

    def __init__(self, send: torch.Tensor, groups: ParallelGroups) -> None:
        size, rank, ranks = groups.cp_size, groups.cp_rank, groups.cp_ranks
        self.received = torch.empty_like(send)
        self._works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, ranks[(rank + 1) % size], groups.cp_group),
            dist.P2POp(dist.irecv, self.received, ranks[(rank - 1) % size], groups.cp_group)])
        self._send = send  # kept alive until the send completes

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self.received


def _block(step: int, groups: ParallelGroups, seq: int) -> tuple[str, slice, slice]:
    """(kind, query rows, key rows) of step ``step``'s block (see the module docstring)."""
    source, half = (groups.cp_rank - step) % groups.cp_size, seq // 2
    if step == 0:
        return "own", slice(None), slice(None)
    if source < groups.cp_rank:
        return "early_keys", slice(None), slice(None, half)
    return "late_queries", slice(half, None), slice(None)


class _Peers(NamedTuple):
    """The context group as the ring uses it (``ParallelGroups`` has the same fields)."""

    cp_size: int
    cp_rank: int
    cp_ranks: tuple[int, ...]
    cp_group: Any


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(output shaped like q in q's dtype, laid out [batch, seq, heads, head_dim] in memory; fp32
    log-sum-exp [batch, heads, seq]) of this rank's queries over the whole sequence."""
    batch, heads, seq, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim)
    flash = uses_flash(q)
    # laid out [batch, seq, heads, head_dim], so that joining the heads after attention is a view
    out = torch.zeros(batch, seq, heads, head_dim, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full((batch, heads, seq), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    for step in range(groups.cp_size):
        exchange = _Exchange(kv, groups) if step < groups.cp_size - 1 else None
        kind, rows, keys = _block(step, groups, seq)
        block = (q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], kind == "own", scale)
        block_out, block_lse = flash_forward(*block) if flash else reference_forward(*block)
        _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if exchange is not None:
            kv = exchange.wait()
    return out.to(q.dtype), lse  # keeps the layout


def ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, groups: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v (contiguous, in their dtypes) from the output's, given ``ring_forward``'s
    output and log-sum-exp."""
    seq, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
    flash = uses_flash(q)
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_kv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    kv = torch.stack([k, v])
    for step in range(groups.cp_size):
        exchange = _Exchange(kv, groups) if step < groups.cp_size - 1 else None
        kind, rows, keys = _block(step, groups, seq)
        block = (grad_out[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                 lse[:, :, rows], kind == "own", scale)
        dq, dk, dv = flash_backward(*block) if flash else reference_backward(*block)
        grad_q[:, :, rows] += dq
        grad_kv[0][:, :, keys] += dk
        grad_kv[1][:, :, keys] += dv
        grad_kv = _Exchange(grad_kv, groups).wait()  # on to the next rank; the previous rank's block arrives
        if exchange is not None:
            kv = exchange.wait()
    # copies even in fp32: an operator's outputs must not share memory
    return grad_q.to(q.dtype), grad_kv[0].to(k.dtype, copy=True), grad_kv[1].to(v.dtype, copy=True)


def _resolve_peers(group_name: str, rank: int, ranks: list[int]) -> _Peers:
    return _Peers(len(ranks), rank, tuple(ranks), dist.distributed_c10d._resolve_process_group(group_name))


@torch.library.custom_op("lnstrain::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, rank: int,
                       ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return ring_forward(q, k, v, _resolve_peers(group_name, rank, ranks))


@_ring_attention_op.register_fake
def _(q, k, v, group_name, rank, ranks):
    batch, heads, seq, head_dim = q.shape
    return (q.new_empty((batch, seq, heads, head_dim)).transpose(1, 2),
            q.new_empty((batch, heads, seq), dtype=torch.float32))


@torch.library.custom_op("lnstrain::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, group_name: str, rank: int,
                                ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ring_backward(grad_out, q, k, v, out, lse, _resolve_peers(group_name, rank, ranks))


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group_name, rank, ranks):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, *peers = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.peers = peers
    ctx.mark_non_differentiable(output[1])


def _gradient(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple[torch.Tensor | None, ...]:
    grads = torch.ops.lnstrain.ring_attention_backward(grad_out, *ctx.saved_tensors, *ctx.peers)
    return (*grads, None, None, None)


_ring_attention_op.register_autograd(_gradient, setup_context=_save_for_backward)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's normalised output and log-sum-exp into the running ones (views, in place)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Causal softmax(q kᵀ / √d) v over the whole sequence for this rank's queries.

    q [batch, heads, 2c, head_dim] and k, v [batch, kv_heads, 2c, head_dim] are this rank's two chunks
    (``context.split_for_context``), already rotated at their global positions; the result is shaped
    like q. Collective over the context group: every rank of it calls this for the same layer.
    """
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs this rank's two equal chunks; got {q.shape[2]} positions")
    out, _ = torch.ops.lnstrain.ring_attention(q, k, v, groups.cp_group.group_name, groups.cp_rank,
                                               list(groups.cp_ranks))
    return out
