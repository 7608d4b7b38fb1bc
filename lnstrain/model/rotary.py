"""Rotary position embeddings (rotate-half layout, as Hugging Face LLaMA).

Everything here works on heads laid out as the projections produce them, ``[batch, seq, heads,
head_dim]``, with cos/sin tables cached in the exact broadcast shape ``[seq, 1, head_dim]``. Positions
are global: under context parallelism a rank's tokens are two chunks of the sequence
(``parallel.context.local_positions``), rotated at their positions in the whole sequence.

rotate(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

For the fused q|k|v projection, ``RotaryEmbedding.fused_qkv`` rotates q and k in one pass over
their contiguous block of heads into a new q|k|v buffer (v copied beside them, so that the
projection's output is freed rather than kept alive for attention's backward by a v view) and, in
backward, writes the gradient of the whole fused output into one buffer. Its results
(forward and gradients) are bitwise those of ``rotate`` applied to q and k separately, which is
what it does under ``torch.compile`` (where inductor fuses the copies away anyway). On CUDA with
Triton, in bf16 or fp16, one kernel (``rotary_kernel``) does each direction in one pass, bitwise the same;
it is used on a device and dtype only after it has given eager's bits there on a small case (once per
process), and the eager ops run otherwise, with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn

from lnstrain.model import rotary_kernel

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
        self._chunk_tables: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        """(positions, device, dtype) and their cos and sin: a context rank's two chunks (``tables_at``)."""

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

    def tables_at(self, positions: Sequence[range], device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the tokens at ``positions`` (consecutive ranges), shaped [tokens, 1, head_dim]."""
        if len(positions) == 1 and positions[0].start == 0:
            return self.tables(len(positions[0]), device, dtype)
        key = (tuple((r.start, r.stop) for r in positions), device, dtype)
        if self._chunk_tables is None or self._chunk_tables[0] != key or torch.compiler.is_compiling():
            cos, sin = self.tables(max(r.stop for r in positions), device, dtype)
            tables = (torch.cat([cos[r.start:r.stop] for r in positions]),
                      torch.cat([sin[r.start:r.stop] for r in positions]))
            if torch.compiler.is_compiling():
                return tables
            self._chunk_tables = (key, tables)
        return self._chunk_tables[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: Sequence[range] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k, shaped [batch, seq, heads, head_dim], by their positions (0..seq-1 when None)."""
        cos, sin = self.tables_at(positions or [range(q.shape[1])], q.device, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def fused_qkv(self, qkv: torch.Tensor, q_heads: int, kv_heads: int,
                  positions: Sequence[range] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q and k, and v, from a fused projection's output [batch, seq, (q_heads + 2 kv_heads) * head_dim],
        at ``positions`` (0..seq-1 when None).

        Returns [batch, seq, heads, head_dim] tensors, views of one new buffer.
        """
        cos, sin = self.tables_at(positions or [range(qkv.shape[1])], qkv.device, qkv.dtype)
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
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int):
        batch, seq, width = qkv.shape
        head_dim = cos.shape[-1]
        heads = qkv.view(batch, seq, width // head_dim, head_dim)
        rotated = torch.empty_like(heads)
        qk = q_heads + kv_heads
        if _use_kernel(heads, cos):
            rotary_kernel.rotate_heads(heads, rotated, cos, sin, qk)
        else:
            _rotate_into(heads[:, :, :qk], cos, sin, rotated[:, :, :qk])
            rotated[:, :, qk:] = heads[:, :, qk:]
        ctx.save_for_backward(cos, sin)
        ctx.q_heads = q_heads
        ctx.kv_heads = kv_heads
        return rotated[:, :, :q_heads], rotated[:, :, q_heads:qk], rotated[:, :, qk:]

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor):
        cos, sin = ctx.saved_tensors
        q_heads, kv_heads = ctx.q_heads, ctx.kv_heads
        batch, seq, _, head_dim = grad_v.shape
        grad = grad_v.new_empty(batch, seq, q_heads + 2 * kv_heads, head_dim)
        qk = q_heads + kv_heads
        if all(_use_kernel(g, cos) for g in (grad_q, grad_k, grad_v)):
            rotary_kernel.rotate_heads(grad_q, grad[:, :, :q_heads], cos, sin, q_heads, backward=True)
            rotary_kernel.rotate_heads(grad_k, grad[:, :, q_heads:qk], cos, sin, kv_heads, backward=True)
            rotary_kernel.rotate_heads(grad_v, grad[:, :, qk:], cos, sin, 0)
        else:
            _unrotate_into(grad_q, cos, sin, grad[:, :, :q_heads])
            _unrotate_into(grad_k, cos, sin, grad[:, :, q_heads:qk])
            grad[:, :, qk:] = grad_v
        return grad.view(batch, seq, -1), None, None, None, None
