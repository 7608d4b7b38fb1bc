"""Whether the state a save would write is finite: never save non-finite weights as a good checkpoint.

A NaN or Inf can reach the weights or the Adam moments without any step's loss noticing first (a
corrupted optimizer file, a bad update whose effect shows only at the next forward). Before every
save each rank checks what it holds, its model parameters (the local ZeRO-3 partition when
parameters are partitioned) and everything the torch optimizer holds (the fp32 master partitions and
every state tensor) by summing each tensor (a NaN or an infinity makes the sum non-finite; only then
is the tensor checked element by element), and one all-reduce makes every rank agree. The cost is
one read of the rank's state in memory; the save itself writes all of it to disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lnstrain.deepspeed_adapter import local_partition

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

_CHUNK_ELEMENTS = 1 << 26


def _state_tensors(engine: TrainingEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every floating-point tensor of this rank's weights and optimizer state."""
    for name, param in engine.module.named_parameters():
        yield f"parameter {name}", local_partition(param)
    base = engine.base_optimizer  # under ZeRO/bf16/fp16 it holds the fp32 masters
    for g, group in enumerate(base.param_groups):
        for i, param in enumerate(group["params"]):
            yield f"optimizer parameter {i} of group {g}", param
            for key, value in base.state.get(param, {}).items():
                if torch.is_tensor(value):
                    yield f"optimizer state {key!r} of parameter {i} of group {g}", value


def _sum_is_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: False when ``tensor`` holds a NaN or an infinity (they make the sum non-finite),
    or when its sum overflows (finite values too large to add up; ``_is_finite`` tells them apart).
    A sum reads the tensor once without a temporary: on a CPU 20-30 times faster than ``isfinite``."""
    return torch.isfinite(tensor.detach().sum())


def _is_finite(tensor: torch.Tensor) -> bool:
    """Exactly whether every element is finite (in chunks: no full-size temporary)."""
    return all(bool(torch.isfinite(chunk).all()) for chunk in tensor.detach().reshape(-1).split(_CHUNK_ELEMENTS))


def local_nonfinite(engine: TrainingEngine) -> list[str]:
    """Names of this rank's non-finite state tensors (empty: all finite). One host sync when finite."""
    device = torch.device(engine.device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    tensors = [(name, t) for name, t in _state_tensors(engine) if t.is_floating_point() and t.numel()]
    for _, tensor in tensors:
        finite &= _sum_is_finite(tensor).to(device)
    if bool(finite.item()):
        return []
    return [name for name, tensor in tensors if not bool(_sum_is_finite(tensor)) and not _is_finite(tensor)]


def nonfinite_state(engine: TrainingEngine) -> list[str]:
    """Collective (every rank calls it): the non-finite state tensors of every rank, as
    ``rank R: <name>`` lines, the same list on every rank; empty when everything is finite."""
    local = local_nonfinite(engine)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [f"rank 0: {name}" for name in local]
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=torch.device(engine.device))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return []
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, local)
    return [f"rank {rank}: {name}" for rank, names in enumerate(everyone) for name in names]
