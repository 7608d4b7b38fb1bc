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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        batch, heads, seq, head_dim = q.shape
        scale = 1.0 / math.sqrt(head_dim)
        flash = uses_flash(q)
        # laid out [batch, seq, heads, head_dim], so that joining the heads after attention is a view
        out = torch.zeros(batch, seq, heads, head_dim, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full((batch, heads, seq), float("-inf"), dtype=torch.float32, device=q.device)
        aux: dict[str, Any] = {}
        kv = torch.stack([k, v])
        for step in range(groups.cp_size):
            exchange = _Exchange(kv, groups) if step < groups.cp_size - 1 else None
            kind, rows, keys = _block(step, groups, seq)
            block = (q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], kind == "own", scale)
            if flash:
                block_out, block_lse, aux[kind] = flash_forward(*block)
            else:
                block_out, block_lse = reference_forward(*block)
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if exchange is not None:
                kv = exchange.wait()
        result = out.to(q.dtype)  # keeps the layout
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.groups, ctx.flash, ctx.aux = groups, flash, aux
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        groups = ctx.groups
        seq, scale = q.shape[2], 1.0 / math.sqrt(q.shape[3])
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_kv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        kv = torch.stack([k, v])
        for step in range(groups.cp_size):
            exchange = _Exchange(kv, groups) if step < groups.cp_size - 1 else None
            kind, rows, keys = _block(step, groups, seq)
            block = (grad_out[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                     lse[:, :, rows], kind == "own", scale)
            if ctx.flash:
                dq, dk, dv = flash_backward(*block, ctx.aux[kind])
            else:
                dq, dk, dv = reference_backward(*block)
            grad_q[:, :, rows] += dq
            grad_kv[0][:, :, keys] += dk
            grad_kv[1][:, :, keys] += dv
            grad_kv = _Exchange(grad_kv, groups).wait()  # on to the next rank; the previous rank's block arrives
            if exchange is not None:
                kv = exchange.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None


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
    return _RingAttention.apply(q, k, v, groups)
