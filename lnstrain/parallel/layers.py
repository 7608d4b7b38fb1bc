"""Megatron-style tensor-parallel layers (no biases: LLaMA has none).

Every layer can cut a full (unsharded) weight into this rank's shard (`shard`) and put
the shards of all ranks back together (`unshard`); init and checkpoint conversion use them.

A column-parallel weight is a stack of named `OutputPart`s (e.g. q, k, v), each sharded on
its own, so that a fused projection's shard holds this rank's slice of every part. A part
made of fewer units (heads) than there are ranks is replicated: rank r holds unit
r * units // tp, and its gradient is a partial sum (see `allreduce_replicated_grads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lnstrain.parallel.mappings import enter_tp_region, exit_tp_region, gather_from_tp

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


@dataclass(frozen=True)
class OutputPart:
    """A named block of output features, made of `units` equal, indivisible units."""

    name: str
    size: int
    units: int

    def local_slice(self, tp_rank: int, tp_size: int) -> slice:
        pieces = min(self.units, tp_size)
        length = self.size // pieces
        start = (tp_rank * pieces // tp_size) * length
        return slice(start, start + length)

    def is_replicated(self, tp_size: int) -> bool:
        return self.units < tp_size


def _check_parts(parts: Sequence[OutputPart], tp_size: int) -> None:
    for part in parts:
        pieces = min(part.units, tp_size)
        if part.size % part.units or tp_size % pieces or part.units % pieces:
            raise ValueError(f"part {part} cannot be split across tensor-parallel size {tp_size}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split across tensor-parallel ranks.

    Input: the full activation. Unless `input_in_region`, the layer enters the tensor-parallel
    region itself (copy, or sequence all-gather); layers sharing one input enter it once and
    pass `input_in_region=True`. Output: this rank's features of every part, concatenated.
    """

    def __init__(self, in_features: int, parts: Sequence[OutputPart], groups: ParallelGroups, *,
                 input_in_region: bool = False, gather_output: bool = False) -> None:
        super().__init__()
        _check_parts(parts, groups.tp_size)
        self.in_features = in_features
        self.parts = tuple(parts)
        self.groups = groups
        self.input_in_region = input_in_region
        self.gather_output = gather_output
        if gather_output and any(p.is_replicated(groups.tp_size) for p in self.parts):
            raise ValueError("gather_output needs every part sharded, none replicated")
        self.local_sizes = [self._local(p).stop - self._local(p).start for p in self.parts]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features))

    def _local(self, part: OutputPart) -> slice:
        return part.local_slice(self.groups.tp_rank, self.groups.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_tp_region(x, self.groups)
        y = F.linear(x, self.weight)
        return gather_from_tp(y, self.groups) if self.gather_output else y

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full weight whose rows are the parts, in order."""
        full_parts = full_weight.split([p.size for p in self.parts])
        return torch.cat([w[self._local(p)] for p, w in zip(self.parts, full_parts)])

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full weight (or gradient) from every rank's shard, in rank order."""
        tp = self.groups.tp_size
        per_rank = [s.split(self.local_sizes) for s in shards]
        full = []
        for index, part in enumerate(self.parts):
            pieces = min(part.units, tp)
            full += [per_rank[piece * tp // pieces][index] for piece in range(pieces)]
        return torch.cat(full)

    def allreduce_replicated_grads(self) -> None:
        """Sum each replicated part's gradient over the ranks that hold the same unit."""
        tp = self.groups.tp_size
        if self.weight.grad is None or not any(p.is_replicated(tp) for p in self.parts):
            return
        local_grads = self.weight.grad.split(self.local_sizes)
        for part, local_grad in zip(self.parts, local_grads):
            if part.is_replicated(tp):
                full = local_grad.new_zeros(part.size, self.in_features)
                full[self._local(part)] = local_grad
                dist.all_reduce(full, group=self.groups.tp_group)
                # Every rank holding this unit added the same slot, so the slot is their sum.
                local_grad.copy_(full[self._local(part)])

    def extra_repr(self) -> str:
        parts = ", ".join(f"{p.name}={p.size}" for p in self.parts)
        return f"in={self.in_features}, parts=({parts}), local_out={sum(self.local_sizes)}"


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split across ranks; the input is the
    column-parallel layer's sharded output, and the partial results are summed on exit."""

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups, *, name: str) -> None:
        super().__init__()
        if in_features % groups.tp_size:
            raise ValueError(f"{name}: in_features {in_features} not divisible by tp={groups.tp_size}")
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features // groups.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_tp_region(F.linear(x, self.weight), self.groups)

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        return full_weight.chunk(self.groups.tp_size, dim=1)[self.groups.tp_rank]

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(shards), dim=1)

    def extra_repr(self) -> str:
        return f"name={self.name}, in={self.in_features}, out={self.out_features}, tp={self.groups.tp_size}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split across ranks by contiguous ranges.

    Output: hidden states, replicated (or sequence-sharded under sequence parallelism).
    """

    def __init__(self, padded_vocab_size: int, hidden_size: int, groups: ParallelGroups) -> None:
        super().__init__()
        if padded_vocab_size % groups.tp_size:
            raise ValueError(f"padded vocabulary {padded_vocab_size} not divisible by tp={groups.tp_size}")
        self.padded_vocab_size = padded_vocab_size
        self.groups = groups
        self.local_vocab_size = padded_vocab_size // groups.tp_size
        self.vocab_start = groups.tp_rank * self.local_vocab_size
        self.weight = nn.Parameter(torch.empty(self.local_vocab_size, hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.groups.tp_size == 1:
            return F.embedding(tokens, self.weight)
        local_ids = tokens - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.local_vocab_size)
        embedded = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(embedded, self.groups)

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        return full_weight[self.vocab_start:self.vocab_start + self.local_vocab_size]

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(shards))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Logits for this rank's vocabulary shard from a [local_vocab, hidden] weight
    (the output head's, or the tied embedding's)."""
    return F.linear(enter_tp_region(hidden, groups), weight)
