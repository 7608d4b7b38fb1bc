"""Live tensor bytes on any device: the CPU's (and fake tensors') stand-in for CUDA's allocator statistics.

``LiveTensorBytes`` is a dispatch mode that sees every tensor an operator returns while it is
active, counts each storage once, at its current size, and subtracts it when the storage is freed
(a weak reference's callback). ``peak`` is then the high-water mark of tensor memory, like
``torch.cuda.max_memory_allocated`` without the allocator's rounding, and it works for real CPU
tensors and for ``FakeTensorMode`` tensors alike, so the memory of a model far larger than the
machine can be traced without allocating it (``activation_trace``).

On the CPU, 16-bit matrix products run in fp32 and are rounded back (an AVX2 CPU's native bf16 GEMM
is about 40 times slower than fp32's, and only bytes are measured here): the results keep their
dtype and shape, the fp32 temporaries are not counted, and the values differ from a native 16-bit
GEMM by rounding only, as a GPU's fp32-accumulating one does.

Only tensors created while the mode is active are counted (enter it before building what is
measured); memory allocated outside torch's dispatcher (communication buffers, workspaces) is not,
nor are meta tensors (shapes without storage; fake tensors report the device they stand in for).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


_MATRIX_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                    torch.ops.aten.baddbmm.default}
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _is_half_cpu_tensor(value) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.device.type == "cpu" and value.dtype in _HALF_DTYPES


def _matrix_product_in_fp32(func, args: tuple, kwargs: dict):
    """``func`` on fp32 copies of its 16-bit CPU operands, rounded back to their dtype."""
    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
    upcast = [a.float() if _is_half_cpu_tensor(a) else a for a in args]
    return func(*upcast, **kwargs).to(dtype)


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
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if (func in _MATRIX_PRODUCTS and all(_is_half_cpu_tensor(t) for t in tensors)
                and len({t.dtype for t in tensors}) == 1):  # anything else: the native op (and its errors)
            out = _matrix_product_in_fp32(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out
