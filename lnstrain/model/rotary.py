"""Rotary position embeddings (rotate-half layout, as Hugging Face LLaMA).

Everything here works on heads laid out as the projections produce them, ``[batch, seq, heads,
head_dim]``, with cos/sin tables cached in the exact broadcast shape ``[seq, 1, head_dim]``.

rotate(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

For the fused q|k|v projection, ``RotaryEmbedding.fused_qkv`` rotates q and k and copies v out of the
projection's output in one pass over memory each way, so that the output is freed rather than kept
alive for attention's backward by a v view, and in backward writes the gradient of the whole fused
output into one buffer. Its results (forward and gradients) are bitwise those of ``rotate`` applied to
q and k separately. Two forms:

* with ``triton_kernel`` on (the default, where ``build.select_triton_kernels`` finds the kernel usable):
  the custom ops ``lnstrain::rotate_qkv`` and ``lnstrain::rotate_qkv_backward``, which run the Triton
  kernel (``rotary_kernel``: one launch per part) where it applies and has given eager's bits on the
  device and dtype (checked once per process, with a warning and the eager ops otherwise), and the eager
  ops elsewhere. ``torch.compile`` sees them as opaque operators (fake implementations give the shapes),
  so compiled layers run the kernel too;
* with it off: an autograd function over eager ops into one buffer, or under ``torch.compile`` the plain
  rotation of q and k, which inductor fuses itself.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from lnstrain.model import rotary_kernel
from lnstrain.model.triton_common import runs_on

logger = logging.getLogger(__name__)


class RotaryEmbedding(nn.Module):
    """Caches cos/sin tables for the device, dtype and length last asked for.

    The cache is a non-persistent buffer: absent from checkpoints, rebuilt lazily (so a
    model built on the meta device needs nothing materialised here).
    """

    cos_cached: torch.Tensor | None
    sin_cached: torch.Tensor | None

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("cos_cached", None, persistent=False)
        self.register_buffer("sin_cached", None, persistent=False)
        self.triton_kernel = True
        """``fused_qkv`` through the custom ops (the Triton kernel where it is usable); ``build.select_triton_kernels``
        turns it off where the kernel cannot run, so that compiled layers fuse the plain ops there instead."""

    def tables(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions 0..seq_len-1, shaped [seq_len, 1, head_dim]."""
        if torch.compiler.is_compiling():
            # computed in the graph (inductor folds it): guards on the cache's state would compile each
            # layer twice, and a recompilation is where dynamo specialises on LNS's per-layer float
            return self._compute(seq_len, device, dtype)
        cached = self.cos_cached
        if cached is None or cached.shape[0] < seq_len or cached.device != device or cached.dtype != dtype:
            self.cos_cached, self.sin_cached = self._compute(seq_len, device, dtype)
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]

    def _compute(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k, shaped [batch, seq, heads, head_dim], by their positions 0..seq-1."""
        cos, sin = self.tables(q.shape[1], q.device, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def fused_qkv(self, qkv: torch.Tensor, q_heads: int,
                  kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q and k, and v, from a fused projection's output [batch, seq, (q_heads + 2 kv_heads) * head_dim].

        Returns [batch, seq, heads, head_dim] tensors, none of them a view of ``qkv``.
        """
        cos, sin = self.tables(qkv.shape[1], qkv.device, qkv.dtype)
        if self.triton_kernel:
            return tuple(torch.ops.lnstrain.rotate_qkv(qkv, cos, sin, q_heads, kv_heads))
        if torch.compiler.is_compiling():  # inductor fuses the plain ops; dynamo cannot trace `out=` views
            batch, seq, width = qkv.shape
            heads = qkv.view(batch, seq, width // self.head_dim, self.head_dim)
            q, k, v = heads.split([q_heads, kv_heads, kv_heads], dim=2)
            return rotate(q, cos, sin), rotate(k, cos, sin), v
        return _RotateFusedQKV.apply(qkv, cos, sin, q_heads, kv_heads)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [batch, seq, heads, head_dim] (autograd's own backward)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """``rotate(x, cos, sin)``, the same roundings, written into ``out`` with fewer passes over memory."""
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    rotated_sin = torch.empty_like(out)
    torch.mul(x[..., half:], sin[..., :half], out=rotated_sin[..., :half]).neg_()  # -(a*b) == (-a)*b exactly
    torch.mul(x[..., :half], sin[..., half:], out=rotated_sin[..., half:])
    out.add_(rotated_sin)


def _unrotate_into(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """The gradient of ``rotate`` (grad * cos + rotate_half^T(grad * sin)), written into ``out``."""
    half = grad.shape[-1] // 2
    torch.mul(grad, cos, out=out)
    grad_sin = grad * sin
    out[..., :half] += grad_sin[..., half:]
    out[..., half:] -= grad_sin[..., :half]


def _use_kernel(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return rotary_kernel.supports(x, cos) and kernel_matches_eager(x.device, x.dtype)


def kernel_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel can run on ``device`` in ``dtype`` and has given eager's bits there."""
    return runs_on(device, dtype) and kernel_matches_eager(device, dtype)


@functools.lru_cache(maxsize=None)
def kernel_matches_eager(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel builds on ``device`` and gives the eager rotation's bits in ``dtype``,
    forward and backward, on a small case with GQA and an odd number of heads per block."""
    batch, seq, q_heads, kv_heads, head_dim = 2, 7, 6, 3, 32
    generator = torch.Generator().manual_seed(0)
    heads = torch.randn(batch, seq, q_heads + 2 * kv_heads, head_dim, generator=generator).to(device, dtype)
    cos, sin = RotaryEmbedding(head_dim)._compute(seq, device, dtype)
    qk = q_heads + kv_heads
    by_kernel = [torch.empty_like(heads), torch.empty_like(heads)]
    try:
        rotary_kernel.rotate_heads(heads, by_kernel[0], cos, sin, qk)
        rotary_kernel.rotate_heads(heads, by_kernel[1], cos, sin, qk, backward=True)
    except Exception as error:  # a Triton or driver failure of any kind: the eager ops still work
        logger.warning("the Triton rotary kernel failed on %s (%s: %s); rotating with eager ops", device,
                       type(error).__name__, error)
        return False
    eager = [heads.clone(), heads.clone()]
    _rotate_into(heads[:, :, :qk], cos, sin, eager[0][:, :, :qk])
    _unrotate_into(heads[:, :, :qk], cos, sin, eager[1][:, :, :qk])
    if all(torch.equal(a, b) for a, b in zip(by_kernel, eager)):
        return True
    logger.warning("the Triton rotary kernel's %s results on %s differ from the eager rotation's; rotating "
                   "with eager ops", dtype, device)
    return False


class _RotateFusedQKV(torch.autograd.Function):
    """The eager ops' form of ``fused_qkv``: q, k and v views of one new buffer."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int):
        batch, seq, width = qkv.shape
        head_dim = cos.shape[-1]
        heads = qkv.view(batch, seq, width // head_dim, head_dim)
        rotated = torch.empty_like(heads)
        qk = q_heads + kv_heads
        _rotate_into(heads[:, :, :qk], cos, sin, rotated[:, :, :qk])
        rotated[:, :, qk:] = heads[:, :, qk:]
        ctx.save_for_backward(cos, sin)
        return rotated[:, :, :q_heads], rotated[:, :, q_heads:qk], rotated[:, :, qk:]

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_qkv_backward(grad_q, grad_k, grad_v, cos, sin, kernel=False), None, None, None, None


def _parts(heads: torch.Tensor, q_heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return heads[:, :, :q_heads], heads[:, :, q_heads:q_heads + kv_heads], heads[:, :, q_heads + kv_heads:]


@torch.library.custom_op("lnstrain::rotate_qkv", mutates_args=())
def _rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of the fused projection's output rotated, and v copied: three new [batch, seq, heads, head_dim]
    tensors, by the Triton kernel where it is usable (``_use_kernel``), else by the eager ops."""
    batch, seq, width = qkv.shape
    head_dim = cos.shape[-1]
    sources = _parts(qkv.view(batch, seq, width // head_dim, head_dim), q_heads, kv_heads)
    targets = tuple(torch.empty(part.shape, dtype=qkv.dtype, device=qkv.device) for part in sources)
    if _use_kernel(sources[0], cos):
        for source, target, rotated in zip(sources, targets, (q_heads, kv_heads, 0)):
            rotary_kernel.rotate_heads(source, target, cos, sin, rotated)
    else:
        for source, target in zip(sources[:2], targets[:2]):
            _rotate_into(source, cos, sin, target)
        targets[2].copy_(sources[2])
    return targets


@_rotate_qkv.register_fake
def _(qkv, cos, sin, q_heads, kv_heads):
    batch, seq, _ = qkv.shape
    head_dim = cos.shape[-1]
    return tuple(qkv.new_empty(batch, seq, heads, head_dim) for heads in (q_heads, kv_heads, kv_heads))


def _rotate_qkv_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kernel: bool) -> torch.Tensor:
    """The gradient of the fused projection's output [batch, seq, width], in one new buffer."""
    q_heads, kv_heads = grad_q.shape[2], grad_k.shape[2]
    batch, seq, _, head_dim = grad_v.shape
    grad = grad_v.new_empty(batch, seq, q_heads + 2 * kv_heads, head_dim)
    targets = _parts(grad, q_heads, kv_heads)
    if kernel and all(_use_kernel(g, cos) for g in (grad_q, grad_k, grad_v)):
        for source, target, rotated in zip((grad_q, grad_k, grad_v), targets, (q_heads, kv_heads, 0)):
            rotary_kernel.rotate_heads(source, target, cos, sin, rotated, backward=True)
    else:
        _unrotate_into(grad_q, cos, sin, targets[0])
        _unrotate_into(grad_k, cos, sin, targets[1])
        targets[2].copy_(grad_v)
    return grad.view(batch, seq, -1)


@torch.library.custom_op("lnstrain::rotate_qkv_backward", mutates_args=())
def _rotate_qkv_backward_op(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    return _rotate_qkv_backward(grad_q, grad_k, grad_v, cos, sin, kernel=True)


@_rotate_qkv_backward_op.register_fake
def _(grad_q, grad_k, grad_v, cos, sin):
    batch, seq = grad_v.shape[:2]
    width = (grad_q.shape[2] + grad_k.shape[2] + grad_v.shape[2]) * grad_v.shape[3]
    return grad_v.new_empty(batch, seq, width)


def _save_tables(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _rotate_qkv_gradient(ctx, grad_q, grad_k, grad_v):
    cos, sin = ctx.saved_tensors
    return torch.ops.lnstrain.rotate_qkv_backward(grad_q, grad_k, grad_v, cos, sin), None, None, None, None


_rotate_qkv.register_autograd(_rotate_qkv_gradient, setup_context=_save_tables)
