"""RMSNorm and SwiGLU as autograd functions that keep less for backward than autograd would.

Autograd's own graph of these ops keeps every intermediate its backward formulas name:

* ``F.rms_norm`` without a fused kernel (torch's CPU path) keeps an fp32 copy of the input and the
  fp32 normalised input, 8 bytes per element of a bf16 activation; ``rms_norm`` here keeps the input
  in its own dtype and the fp32 reciprocal RMS per row, 2 bytes per element (bf16).
* ``F.silu(gate) * up`` keeps ``silu(gate)`` beside ``gate`` and ``up``; ``swiglu`` here recomputes it
  in backward (one elementwise pass), as Megatron-LM's fused SwiGLU does, so the MLP keeps 6 instead
  of 8 bytes per FFN element (bf16). Its forward and gradients are bitwise autograd's. With
  ``triton_kernel`` (the default) it runs as the custom ops ``lnstrain::swiglu`` and
  ``lnstrain::swiglu_backward``: on CUDA with Triton, in bf16 or fp16, one kernel each way
  (``swiglu_kernel``) does the elementwise work in one pass, used on a device and dtype only after it has
  given the eager ops' bits there on a test case (once per process); the eager ops run otherwise (with a
  warning where the check failed). ``torch.compile`` sees the ops as opaque operators, so compiled layers
  run the kernels too; without ``triton_kernel`` it is an autograd function over plain torch ops, which
  inductor traces and fuses like any other code.

``rms_norm`` is plain torch ops under ``torch.compile`` as well.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from lnstrain.model import swiglu_kernel
from lnstrain.model.triton_common import runs_on

logger = logging.getLogger(__name__)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (``t`` itself when it already is)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without a ``.to`` call when it already is one (see ``_RMSNorm.forward``)."""
    return t if t.dtype == dtype else t.to(dtype)


class _RMSNorm(torch.autograd.Function):
    """y = (x · rstd · gain).to(x.dtype), gain = weight · scale, rstd = (mean(x²) + eps)^-½ in at least
    fp32: torch's roundings. The constant ``scale`` (an fp32 0-dim tensor, a scalar operand, or None for
    1) is applied here, not as an autograd node of its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | None) -> torch.Tensor:
        gain = weight * scale if scale is not None else weight
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
            grad_weight = _cast(grad_gain * ctx.scale if ctx.scale is not None else grad_gain, gain.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normalized = grad32 * _opmath(gain)
            mean_dot = (grad_normalized * normalized).mean(-1, keepdim=True)
            grad_x = _cast(grad_normalized.sub_(normalized.mul_(mean_dot)).mul_(rstd), x.dtype)
        return grad_x, grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """RMS normalisation over the last dimension times ``weight · scale``, keeping x and rstd for backward.
    ``scale``: None (1), or a float or fp32 0-dim tensor (``norms.OutputScale``: one compiled graph for every value)."""
    if isinstance(scale, float | int):
        scale = None if scale == 1.0 else torch.tensor(float(scale), dtype=torch.float32)
    return _RMSNorm.apply(x, weight, eps, scale)


def _swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_backward_eager(grad_out: torch.Tensor, gate: torch.Tensor,
                           up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_up = grad_out * F.silu(gate)
    grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate)
    return grad_gate, grad_up


def _use_swiglu_kernel(*tensors: torch.Tensor) -> bool:
    return swiglu_kernel.supports(*tensors) and swiglu_kernel_matches_eager(tensors[0].device, tensors[0].dtype)


def swiglu_kernel_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton SwiGLU kernels can run on ``device`` in ``dtype`` and have given eager's bits there."""
    return runs_on(device, dtype) and swiglu_kernel_matches_eager(device, dtype)


def _check_values(generator: torch.Generator) -> torch.Tensor:
    """20,499 values, shuffled: normal at scales from 1e-6 to 30, and 0, -0, 100, -100."""
    scales = torch.tensor([1e-6, 0.1, 1.0, 4.0, 30.0]).repeat_interleave(4099)
    values = torch.cat([torch.randn(scales.numel(), generator=generator) * scales,
                        torch.tensor([0.0, -0.0, 100.0, -100.0])])
    return values[torch.randperm(values.numel(), generator=generator)]


@functools.lru_cache(maxsize=None)
def swiglu_kernel_matches_eager(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton SwiGLU kernels build on ``device`` and give the eager ops' bits in ``dtype``,
    forward and backward, on values from -100 to 100 (exp overflowing) down to 1e-6, and signed zeros."""
    generator = torch.Generator().manual_seed(0)
    gate, up, grad_out = (_check_values(generator).to(device, dtype) for _ in range(3))
    try:
        by_kernel = (swiglu_kernel.forward(gate, up), *swiglu_kernel.backward(grad_out, gate, up))
    except Exception as error:  # a Triton or driver failure of any kind: the eager ops still work
        logger.warning("the Triton SwiGLU kernels failed on %s (%s: %s); using eager ops", device,
                       type(error).__name__, error)
        return False
    eager = (_swiglu_eager(gate, up), *_swiglu_backward_eager(grad_out, gate, up))
    differing = [int((a != b).sum()) for a, b in zip(by_kernel, eager)]
    if not any(differing):
        return True
    examples = []
    for name, ours, reference in zip(("out", "grad gate", "grad up"), by_kernel, eager):
        for at in (ours != reference).nonzero().flatten()[:2].tolist():
            examples.append(f"{name} at gate={gate[at].item():.9g} up={up[at].item():.9g} grad={grad_out[at].item():.9g}: "
                            f"kernel {ours[at].item():.9g}, eager {reference[at].item():.9g}")
    logger.warning("the Triton SwiGLU kernels' %s results on %s differ from the eager ops' (%s of %d elements "
                   "in out, grad gate, grad up; %s); using eager ops", dtype, device, differing, gate.numel(),
                   "; ".join(examples))
    return False


class _SwiGLU(torch.autograd.Function):
    """The eager ops' form of ``swiglu`` (and, under ``torch.compile``, plain ops for inductor to fuse)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _swiglu_eager(gate, up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        return _swiglu_backward_eager(grad_out, gate, up)


@torch.library.custom_op("lnstrain::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _use_swiglu_kernel(gate, up):
        return swiglu_kernel.forward(gate, up)
    return _swiglu_eager(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("lnstrain::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_out: torch.Tensor, gate: torch.Tensor,
                        up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_swiglu_kernel(grad_out, gate, up):
        return swiglu_kernel.backward(grad_out, gate, up)
    return _swiglu_backward_eager(grad_out, gate, up)


@_swiglu_backward_op.register_fake
def _(grad_out, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_gradient(ctx, grad_out):
    gate, up = ctx.saved_tensors
    return tuple(torch.ops.lnstrain.swiglu_backward(grad_out, gate, up))


_swiglu_op.register_autograd(_swiglu_gradient, setup_context=_save_inputs)


def swiglu(gate: torch.Tensor, up: torch.Tensor, triton_kernel: bool = True) -> torch.Tensor:
    """silu(gate) · up, recomputing silu(gate) in backward instead of keeping it; through the custom ops
    (the Triton kernels where usable) with ``triton_kernel``, else plain torch ops."""
    if triton_kernel:
        return torch.ops.lnstrain.swiglu(gate, up)
    return _SwiGLU.apply(gate, up)
