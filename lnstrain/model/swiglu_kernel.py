"""One Triton kernel each way for SwiGLU's elementwise part, ``silu(gate) · up`` (``kernels.swiglu``),
forming every value as eager torch's CUDA kernels form it.

Eager torch runs the forward as two kernels (silu, then the product: five passes over memory) and the
backward as four (silu again, two products, silu's backward: eleven passes); on an H100 they took
94 ms of the 1B model's 1.40 s eager training step (``docs/performance.md``). Here each direction is one
kernel that reads its inputs once and writes its outputs once: three passes forward, five backward.

Each value is computed in fp32 from the 16-bit operands and rounded to the 16-bit dtype wherever eager
stores a tensor (r), in the order of torch's ``silu`` and ``silu_backward`` CUDA kernels:

    forward   s = r(g / (1 + exp(-g)))      out = r(s · u)
    backward  grad_up = r(d · s)            t = r(d · u)
              σ = 1 / (1 + exp(-g))         grad_gate = r(t · σ · (1 + g · (1 - σ)))

with CUDA's ``expf`` and correctly rounded division, as torch's kernels are compiled
(``triton_common``). Whether the bits then agree with eager's on a given GPU is checked there, once
per process (``kernels.swiglu_kernel_matches_eager``), before the kernel is used.

Triton is optional: ``supports`` is False without it, and ``kernels.swiglu`` runs the eager ops.
"""

from __future__ import annotations

import torch

from lnstrain.model.triton_common import exp_like_torch as _exp
from lnstrain.model.triton_common import round_like_torch as _round
from lnstrain.model.triton_common import runs_on, tl, triton

_BLOCK = 1024
"""Elements per program: with 4 warps, 8 consecutive 16-bit elements (16 bytes) per thread and tensor."""


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on ``tensors`` (gate, up and, backward, the output's gradient):
    Triton importable, CUDA tensors (or the interpreter), one 16-bit dtype, one shape, contiguous, not empty."""
    first = tensors[0]
    return (runs_on(first.device, first.dtype) and first.numel() > 0
            and all(t.dtype == first.dtype and t.shape == first.shape and t.device == first.device
                    and t.is_contiguous() for t in tensors))


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, a new tensor."""
    out = torch.empty_like(gate)
    count = gate.numel()
    _swiglu_forward_kernel[(triton.cdiv(count, _BLOCK),)](gate, up, out, count, BLOCK=_BLOCK,
                                                          BF16=gate.dtype == torch.bfloat16)
    return out


def backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of silu(gate) · up with respect to gate and up, given the output's ``grad_out``."""
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    count = gate.numel()
    _swiglu_backward_kernel[(triton.cdiv(count, _BLOCK),)](grad_out, gate, up, grad_gate, grad_up, count,
                                                           BLOCK=_BLOCK, BF16=gate.dtype == torch.bfloat16)
    return grad_gate, grad_up


if triton is not None:
    @triton.jit
    def _swiglu_forward_kernel(gate, up, out, count, BLOCK: tl.constexpr, BF16: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < count
        g = tl.load(gate + at, mask=inside).to(tl.float32)
        u = tl.load(up + at, mask=inside).to(tl.float32)
        silu = _round(tl.math.div_rn(g, 1.0 + _exp(-g)), BF16)
        tl.store(out + at, _round(silu * u, BF16).to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_backward_kernel(grad_out, gate, up, grad_gate, grad_up, count,
                                BLOCK: tl.constexpr, BF16: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = at < count
        d = tl.load(grad_out + at, mask=inside).to(tl.float32)
        g = tl.load(gate + at, mask=inside).to(tl.float32)
        u = tl.load(up + at, mask=inside).to(tl.float32)
        e = _exp(-g)
        silu = _round(tl.math.div_rn(g, 1.0 + e), BF16)
        tl.store(grad_up + at, _round(d * silu, BF16).to(grad_up.dtype.element_ty), mask=inside)
        grad_silu = _round(d * u, BF16)
        sigmoid = tl.math.div_rn(1.0, 1.0 + e)
        grad_g = grad_silu * sigmoid * (1.0 + g * (1.0 - sigmoid))
        tl.store(grad_gate + at, _round(grad_g, BF16).to(grad_gate.dtype.element_ty), mask=inside)
