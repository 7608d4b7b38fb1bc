"""Megatron-style tensor-parallel layers (no biases: LLaMA has none).

Every layer can cut a full (unsharded) weight into this rank's shard (`shard`) and put
the shards of all ranks back together (`unshard`); init and checkpoint conversion use them.

A column-parallel weight is a stack of named `OutputPart`s (e.g. q, k, v), each sharded on
its own, so that a fused projection's shard holds this rank's slice of every part. A part
made of fewer units (heads) than there are ranks is replicated: rank r holds unit
r * units // tp, shared with its tp / units neighbours, and each copy sees only its own
rank's uses; backward sums the copies' gradients over those neighbours, inside autograd.

The linear layers compute in float8 when given a recipe (``fp8``, set on the transformer blocks' layers by
``model.build.set_fp8_mode``; ``parallel.float8``), with scales that make tensor- and context-parallel FP8
equal to single-process FP8.

Each sharded weight carries the attributes DeepSpeed (and lnstrain's own clipping) read:
`tensor_model_parallel` (count this rank's gradient in the global norm; parameters without it
are counted on tensor rank 0 only), `partition_dim` and `partition_stride` (as Megatron sets them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lnstrain.parallel.float8 import Float8Recipe, fits_float8, float8_linear
from lnstrain.parallel.mappings import enter_tp_region, exit_tp_region, gather_from_tp, linear_summing_replica_grads

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

    def copies(self, tp_size: int) -> int:
        """How many neighbouring tensor ranks hold each piece (1 when sharded)."""
        return tp_size // min(self.units, tp_size)


class ShardedWeightLayer(nn.Module):
    """A layer whose ``weight`` is cut across tensor ranks along ``partition_dim``."""

    partition_dim: int
    groups: ParallelGroups
    weight: nn.Parameter
    fp8: Float8Recipe | None = None
    """The float8 recipe of this layer's products (``parallel.float8``); None: the activations' dtype."""

    def weight_counted_here(self) -> bool:
        """Whether this rank's weight gradient belongs in the global gradient norm."""
        return self.groups.tp_size > 1

    def product(self, x: torch.Tensor, weight: torch.Tensor,
                replica_rows: Sequence[tuple[slice, object]] = ()) -> torch.Tensor:
        """x weightᵀ (``weight`` this layer's, or a block of its rows), in float8 under ``fp8`` where the
        shapes allow it; ``replica_rows`` as in ``mappings.linear_summing_replica_grads``."""
        if self.fp8 is not None and fits_float8(x, weight):
            split = self.groups.tp_group if self.groups.tp_size > 1 else None
            return float8_linear(x, weight, self.fp8, k_group=split if self.partition_dim == 1 else None,
                                 n_group=split if self.partition_dim == 0 else None,
                                 m_group=self.groups.cp_group if self.groups.cp_size > 1 else None,
                                 replica_rows=replica_rows)
        if replica_rows:
            return linear_summing_replica_grads(x, weight, replica_rows)
        return F.linear(x, weight)

    def mark_weight(self) -> None:
        """Set the weight's markers (init_weights sets them again: ``to_empty`` makes new Parameters)."""
        self.weight.tensor_model_parallel = self.weight_counted_here()
        self.weight.partition_dim = self.partition_dim
        self.weight.partition_stride = 1


def _check_parts(parts: Sequence[OutputPart], tp_size: int) -> None:
    for part in parts:
        pieces = min(part.units, tp_size)
        if part.size % part.units or tp_size % pieces or part.units % pieces:
            raise ValueError(f"part {part} cannot be split across tensor-parallel size {tp_size}")


class ColumnParallelLinear(ShardedWeightLayer):
    """y = x W^T with W's rows (output features) split across tensor-parallel ranks.

    Input: the full activation. Unless `input_in_region`, the layer enters the tensor-parallel
    region itself (copy, or sequence all-gather); layers sharing one input enter it once and
    pass `input_in_region=True`. Output: this rank's features of every part, concatenated.
    """

    partition_dim = 0

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
        self.replica_rows = self._replica_rows()
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features))
        self.mark_weight()

    def _local(self, part: OutputPart) -> slice:
        return part.local_slice(self.groups.tp_rank, self.groups.tp_size)

    def _replica_rows(self) -> list[tuple[slice, int]]:
        """(local rows, copies) of the replicated parts; neighbouring parts with equal copies merged."""
        blocks: list[tuple[slice, int]] = []
        start = 0
        for part, size in zip(self.parts, self.local_sizes):
            copies = part.copies(self.groups.tp_size)
            if copies > 1 and blocks and blocks[-1][0].stop == start and blocks[-1][1] == copies:
                blocks[-1] = (slice(blocks[-1][0].start, start + size), copies)
            elif copies > 1:
                blocks.append((slice(start, start + size), copies))
            start += size
        return blocks

    def weight_counted_here(self) -> bool:
        """Sharded parts: every rank's gradient counts. Replicated parts only (separate k and v
        projections): the first holder's of each copy. A weight mixing both (fused q, k, v with
        replicated k, v) has no exact per-parameter answer: every rank counts it, so its replicated
        rows are counted `copies` times (``config.feasibility.layout_problems`` refuses that with clipping)."""
        tp = self.groups.tp_size
        if tp == 1:
            return False
        copies = {part.copies(tp) for part in self.parts}
        if len(copies) == 1 and (only := copies.pop()) > 1:
            return self.groups.tp_rank % only == 0
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_tp_region(x, self.groups)
        replicas = [(rows, self.groups.tp_replica_group(copies)) for rows, copies in self.replica_rows]
        y = self.product(x, self.weight, replicas)
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

    def extra_repr(self) -> str:
        parts = ", ".join(f"{p.name}={p.size}" for p in self.parts)
        return f"in={self.in_features}, parts=({parts}), local_out={sum(self.local_sizes)}"


class RowParallelLinear(ShardedWeightLayer):
    """y = x W^T with W's columns (input features) split across ranks; the input is the
    column-parallel layer's sharded output, and the partial results are summed on exit."""

    partition_dim = 1

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups, *, name: str) -> None:
        super().__init__()
        if in_features % groups.tp_size:
            raise ValueError(f"{name}: in_features {in_features} not divisible by tp={groups.tp_size}")
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features // groups.tp_size))
        self.mark_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_tp_region(self.product(x, self.weight), self.groups)

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        return full_weight.chunk(self.groups.tp_size, dim=1)[self.groups.tp_rank]

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(shards), dim=1)

    def extra_repr(self) -> str:
        return f"name={self.name}, in={self.in_features}, out={self.out_features}, tp={self.groups.tp_size}"


class VocabParallelEmbedding(ShardedWeightLayer):
    """Token embedding with the (padded) vocabulary split across ranks by contiguous ranges.

    Output: hidden states, replicated (or sequence-sharded under sequence parallelism).
    """

    partition_dim = 0

    def __init__(self, padded_vocab_size: int, hidden_size: int, groups: ParallelGroups) -> None:
        super().__init__()
        if padded_vocab_size % groups.tp_size:
            raise ValueError(f"padded vocabulary {padded_vocab_size} not divisible by tp={groups.tp_size}")
        self.padded_vocab_size = padded_vocab_size
        self.groups = groups
        self.local_vocab_size = padded_vocab_size // groups.tp_size
        self.vocab_start = groups.tp_rank * self.local_vocab_size
        self.weight = nn.Parameter(torch.empty(self.local_vocab_size, hidden_size))
        self.mark_weight()

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
