"""What lnstrain's Triton kernels share: Triton as an optional import, whether Triton's CPU interpreter
is on, and the two operations a kernel needs to give eager torch's bits on CUDA.

* ``round_like_torch``: fp32 to bf16 or fp16 with round-to-nearest-even, kept in fp32. bf16 is rounded
  with integer arithmetic because the interpreter's bf16 conversion truncates; on the GPU the result
  is the same as the hardware conversion, so tests in the interpreter check what the GPU computes.
* ``exp_like_torch``: CUDA's ``expf`` (libdevice's), which torch's elementwise kernels call. Triton's
  own ``tl.exp`` is the faster, less exact ``ex2.approx`` of x·log2(e). The interpreter has no
  libdevice and uses numpy's ``exp`` (so transcendental results there can differ from the GPU's, and
  from the CPU's, in the last bit).

Triton comes with CUDA builds of torch; without it ``triton`` is None and no kernel is ever used.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU builds of torch come without Triton
    triton = None
    tl = None
    libdevice = None


KERNEL_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes lnstrain's Triton kernels compute in (fp32 training keeps the eager ops)."""


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET=1`` set before Python started)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a Triton kernel can run on ``device`` in ``dtype``: Triton importable, a CUDA device (or the
    interpreter), a 16-bit dtype. Whether it gives eager's bits there is each kernel's own check."""
    return triton is not None and (device.type == "cuda" or interpreting()) and dtype in KERNEL_DTYPES


if triton is not None:
    _INTERPRETED = tl.constexpr(interpreting())

    @triton.jit
    def round_like_torch(value, BF16: tl.constexpr):
        """fp32 ``value`` rounded to the nearest bf16 (ties to even) or fp16, kept in fp32."""
        if BF16:
            bits = value.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))
        return value.to(tl.float16).to(tl.float32)

    @triton.jit
    def exp_like_torch(value):
        """exp of fp32 ``value`` as CUDA's ``expf`` computes it (numpy's in the interpreter)."""
        if _INTERPRETED:
            return tl.exp(value)
        return libdevice.exp(value)
else:
    round_like_torch = exp_like_torch = None
