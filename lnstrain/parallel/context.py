"""Where each context rank's tokens sit in the sequence: causally load-balanced chunks.

A sequence of length S is cut into 2N chunks of c = S / 2N tokens; rank i of the N context ranks
holds chunks i and 2N-1-i, one from the cheap start of the causal triangle and one from its
expensive end, so every rank does the same attention work (Megatron-LM's and TransformerEngine's
layout). Everything else in the model works on the local 2c tokens as if they were a sequence of
their own; only attention (``ring_attention``, ``all_to_all_attention``) and rotary positions
(``local_positions``) look past the cut. Splitting is pure indexing: nothing is communicated here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


def chunk_ranges(seq_len: int, cp_size: int, cp_rank: int) -> tuple[range, range]:
    """The global positions of rank ``cp_rank``'s two chunks of a ``seq_len``-token sequence."""
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 × {cp_size} equal chunks "
                         f"(parallel.context {cp_size}); data.seq_len must be divisible by {chunks}")
    size = seq_len // chunks
    late = chunks - 1 - cp_rank
    return range(cp_rank * size, (cp_rank + 1) * size), range(late * size, (late + 1) * size)


def split_for_context(x: torch.Tensor, dim: int, groups: ParallelGroups) -> torch.Tensor:
    """This context rank's two chunks of the full sequence along ``dim``, early chunk first."""
    if groups.cp_size == 1:
        return x
    early, late = chunk_ranges(x.shape[dim], groups.cp_size, groups.cp_rank)
    return torch.cat([x.narrow(dim, early.start, len(early)), x.narrow(dim, late.start, len(late))], dim=dim)


def local_positions(local_len: int, groups: ParallelGroups) -> list[range]:
    """The global positions of a rank's ``local_len`` tokens: its two chunks, or 0..local_len-1 at context 1."""
    if groups.cp_size == 1:
        return [range(local_len)]
    return list(chunk_ranges(local_len * groups.cp_size, groups.cp_size, groups.cp_rank))


def natural_order(cp_size: int, local_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices that put the concatenated local sequences of ranks 0..N-1 (each its two chunks) back in
    sequence order: ``gathered.index_select(dim, natural_order(...))`` is the sequence."""
    seq_len = local_len * cp_size
    owner = torch.empty(seq_len, dtype=torch.long)
    offset = 0
    for rank in range(cp_size):
        for chunk in chunk_ranges(seq_len, cp_size, rank):
            owner[chunk.start:chunk.stop] = torch.arange(offset, offset + len(chunk))
            offset += len(chunk)
    return owner.to(device) if device is not None else owner
