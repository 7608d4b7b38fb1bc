"""RMSNorm and SwiGLU as autograd functions that keep less for backward than autograd would.

Autograd's own graph of these ops keeps every intermediate its backward formulas name:

* ``F.rms_norm`` without a fused kernel (torch's CPU path) keeps an fp32 copy of the input and the
  fp32 normalised input, 8 bytes per element of a bf16 activation; ``rms_norm`` here keeps the input
  in its own dtype and the fp32 reciprocal RMS per row, 2 bytes per element (bf16).
* ``F.silu(gate) * up`` keeps ``silu(gate)`` beside ``gate`` and ``up``; ``swiglu`` here recomputes it
  in backward (one elementwise pass), as Megatron-LM's fused SwiGLU does, so the MLP keeps 6 instead
  of 8 bytes per FFN element (bf16). Its forward and gradients are bitwise autograd's.

Both are plain torch ops inside, so ``torch.compile`` traces and fuses them like any other code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (``t`` itself when it already is)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without a ``.to`` call when it already is one (see ``_RMSNorm.forward``)."""
    return t if t.dtype == dtype else t.to(dtype)


class _RMSNorm(torch.autograd.Function):
    """y = (x · rstd · gain).to(x.dtype), gain = weight · scale, rstd = (mean(x²) + eps)^-½ in at least
    fp32: torch's roundings. The constant ``scale`` is applied here, not as an autograd node of its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
        gain = weight * scale if scale != 1.0 else weight
        x32 = _opmath(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, gain, rstd)
        ctx.scale = scale
        # A fresh tensor, never one an in-place op or a same-dtype .to returned: torch 2.11 compiles an
        # autograd.Function whose output is either into one whose gradients are all zero.
        return _cast(x32 * rstd * gain, x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, gain, rstd = ctx.saved_tensors
        normalized = _opmath(x) * rstd
        grad32 = _opmath(grad_out)  # ``grad_out`` itself when fp32: never written to below
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows = grad32.reshape(-1, grad32.shape[-1])
            grad_gain = (rows * normalized.reshape(rows.shape)).sum(0)
            grad_weight = _cast(grad_gain * ctx.scale if ctx.scale != 1.0 else grad_gain, gain.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normalized = grad32 * _opmath(gain)
            mean_dot = (grad_normalized * normalized).mean(-1, keepdim=True)
            grad_x = _cast(grad_normalized.sub_(normalized.mul_(mean_dot)).mul_(rstd), x.dtype)
        return grad_x, grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: float = 1.0) -> torch.Tensor:
    """RMS normalisation over the last dimension times ``weight · scale``, keeping x and rstd for backward."""
    return _RMSNorm.apply(x, weight, eps, float(scale))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = grad_out * F.silu(gate)
        grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, recomputing silu(gate) in backward instead of keeping it."""
    return _SwiGLU.apply(gate, up)
