"""One Triton kernel for ``rotary._RotateFusedQKV``: rotate q and k and copy v in a single pass over
memory forward, and the same for their gradients backward, with eager torch's roundings (bitwise).

Eager torch does that rotation in five elementwise kernels forward (and four per tensor backward),
each over strided or broadcast operands, which TensorIterator runs unvectorised: on an H100 they were
~11% of the 1B model's training step (``docs/gpu_check``). Here each element is read and written once.

The result is bitwise eager's: every product and sum is formed in fp32 from 16-bit operands and
rounded to the 16-bit dtype where eager stores it (round to nearest even), in eager's order:

    forward   y1 = r(r(x1·cos1) - r(x2·sin1))    y2 = r(r(x2·cos2) + r(x1·sin2))
    backward  g1 = r(r(d1·cos1) + r(d2·sin2))    g2 = r(r(d2·cos2) - r(d1·sin1))

(x = [x1, x2] the halves of a head, r the rounding, ``triton_common.round_like_torch``, which Triton's
CPU interpreter (``TRITON_INTERPRET=1``) computes as the GPU does: the tests run the kernel there).

Triton is optional: ``supports`` is False without it, and ``rotary`` then runs the eager ops.
"""

from __future__ import annotations

import torch

from lnstrain.model.triton_common import round_like_torch as _round
from lnstrain.model.triton_common import runs_on, tl, triton

_MAX_BLOCK_HEADS = 32
"""Heads per program: one position's 32 heads of 64 elements are 4 KiB of bf16 read and written."""


def supports(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel can run on ``x`` [batch, seq, heads, head_dim] with tables ``cos`` [seq, 1, head_dim]:
    Triton importable, a CUDA tensor (or the interpreter), a 16-bit dtype, unit stride along head_dim."""
    return (runs_on(x.device, x.dtype) and cos.dtype == x.dtype and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and cos.stride(-1) == 1)


def rotate_heads(source: torch.Tensor, target: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rotated_heads: int, backward: bool = False) -> None:
    """Write into ``target`` the heads of ``source`` (both [batch, seq, heads, head_dim]): the first
    ``rotated_heads`` rotated by cos/sin [seq, 1, head_dim] (``backward``: by the rotation's transpose,
    the gradient of ``rotate``), the rest copied."""
    batch, seq, heads, head_dim = source.shape
    if target.shape != source.shape:
        raise ValueError(f"target {tuple(target.shape)} does not match source {tuple(source.shape)}")
    half = head_dim // 2
    block_heads = min(_MAX_BLOCK_HEADS, triton.next_power_of_2(heads))
    grid = (batch * seq, triton.cdiv(heads, block_heads))
    _rotate_kernel[grid](
        source, source.stride(0), source.stride(1), source.stride(2),
        target, target.stride(0), target.stride(1), target.stride(2),
        cos, sin, cos.stride(0), seq, heads, rotated_heads,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HEADS=block_heads,
        BACKWARD=backward, BF16=source.dtype == torch.bfloat16)


if triton is not None:
    @triton.jit
    def _rotate_kernel(source, source_b, source_s, source_h, target, target_b, target_s, target_h,
                       cos, sin, table_s, seq, heads, rotated_heads,
                       HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                       BACKWARD: tl.constexpr, BF16: tl.constexpr):
        row = tl.program_id(0)  # one (batch, position)
        b = row // seq
        s = row % seq
        h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        inside = (h < heads) & (d < HALF)
        x_at = source + b.to(tl.int64) * source_b + s.to(tl.int64) * source_s + h * source_h + d
        x1 = tl.load(x_at, mask=inside).to(tl.float32)
        x2 = tl.load(x_at + HALF, mask=inside).to(tl.float32)
        table = s * table_s + d
        on_row = d < HALF
        cos1 = tl.load(cos + table, mask=on_row).to(tl.float32)
        cos2 = tl.load(cos + table + HALF, mask=on_row).to(tl.float32)
        sin1 = tl.load(sin + table, mask=on_row).to(tl.float32)
        sin2 = tl.load(sin + table + HALF, mask=on_row).to(tl.float32)
        if BACKWARD:
            y1 = _round(_round(x1 * cos1, BF16) + _round(x2 * sin2, BF16), BF16)
            y2 = _round(_round(x2 * cos2, BF16) - _round(x1 * sin1, BF16), BF16)
        else:
            y1 = _round(_round(x1 * cos1, BF16) - _round(x2 * sin1, BF16), BF16)
            y2 = _round(_round(x2 * cos2, BF16) + _round(x1 * sin2, BF16), BF16)
        rotate = h < rotated_heads
        y1 = tl.where(rotate, y1, x1)
        y2 = tl.where(rotate, y2, x2)
        y_at = target + b.to(tl.int64) * target_b + s.to(tl.int64) * target_s + h * target_h + d
        tl.store(y_at, y1.to(target.dtype.element_ty), mask=inside)
        tl.store(y_at + HALF, y2.to(target.dtype.element_ty), mask=inside)
