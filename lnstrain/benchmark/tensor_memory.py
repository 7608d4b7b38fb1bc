"""Live tensor bytes on any device: the CPU's (and fake tensors') stand-in for CUDA's allocator statistics.

``LiveTensorBytes`` is a dispatch mode that sees every tensor an operator returns while it is
active, counts each storage once, at its current size, and subtracts it when the storage is freed
(a weak reference's callback). ``peak`` is then the high-water mark of tensor memory, like
``torch.cuda.max_memory_allocated`` without the allocator's rounding, and it works for real CPU
tensors and for ``FakeTensorMode`` tensors alike, so the memory of a model far larger than the
machine can be traced without allocating it (``activation_trace``).

Only tensors created while the mode is active are counted (enter it before building what is
measured); memory allocated outside torch's dispatcher (communication buffers, workspaces) is not,
nor are meta tensors (shapes without storage; fake tensors report the device they stand in for).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":  # shapes only (DeepSpeed keeps meta copies of every parameter)
            return
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        known = self._sizes.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._freed(key))
        elif known == size:
            return
        self._sizes[key] = size
        self.live += size - (known or 0)
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out
