"""Float8 matrix products for linear layers, with dynamic scaling (``precision.fp8``), tensor-parallel aware.

FP8 is a way of computing y = x Wᵀ, not a way of storing anything: the weights, their gradients, the
optimizer state and checkpoints keep their dtypes. Each of a linear layer's three products (the output,
the input's gradient, the weight's gradient) casts its two operands to float8 with scales taken from
their current absolute maxima, multiplies them with ``torch._scaled_mm`` (fp32 accumulation) and returns
the activations' dtype. The two recipes are torchao's float8 training recipes of the same names:

- ``tensorwise``: one scale per tensor, fp32, ``max_representable / amax``; e4m3 for x and W, e5m2 for the
  output gradient g (two more exponent bits for gradients' wider range); the forward product accumulates
  with cuBLAS's fast accumulation, the two gradient products without.
- ``rowwise``: one scale per row of each operand along the product's contraction dimension, rounded down
  to a power of two (so scaling is exact); e4m3 for all three.

With x [M, K], W [N, K], g [M, N], the scales are taken over:

    product          a operand                   b operand
    y  = x Wᵀ        x, each row over K          W, each row over K
    gx = g W         g, each row over N          W, each column over N
    gW = gᵀ x        g, each column over M       x, each column over M

Tensor parallelism: a column-parallel layer holds N / t rows of W (and produces N / t columns of y and
g), a row-parallel layer K / t columns (and receives K / t columns of x). Context parallelism: a rank
holds M / c of a micro-batch's tokens (its two chunks of each sequence, ``parallel.context``). Every
maximum taken over a dimension a rank holds only part of is all-reduced (MAX) over the group that splits
it, the tensor group for K or N, the context group for M (both, one after the other, where both apply:
the maximum over tensor × context), so each rank quantizes its shard with the scale the single process
uses for the whole tensor: the shards' products are terms of the single process's, and parallel FP8
equals single-process FP8 within the summation order, as in 16-bit (``tests/parallel/test_float8.py``;
the weight gradient's terms over M are summed over data × context with the other gradients). Over M go
the tensorwise scales of x and g and the rowwise column scales of the weight-gradient product (M is its
contraction); the rowwise scales along K or N are per token and need no context reduction. The
all-to-all context method (Ulysses) changes nothing here: its linear layers see the rank's M / c tokens
too, the heads are exchanged only inside attention. Where key/value heads are replicated over tensor
ranks (fewer heads than ranks) each copy's output gradient is partial, so its scales are taken over the
part.

Products whose M, N or K is not a multiple of 16 (cuBLAS's FP8 requirement) run in the activations'
dtype, on every device alike. Off CUDA the same scaled product is computed exactly as ``_scaled_mm``
defines it: the float8 values widened to fp32 (exact), an fp32 product, the scales applied after the sum.
torch's own CPU ``_scaled_mm`` gives the same numbers (tested where the build has it: 2.13 for both
recipes, 2.11 tensorwise only), but its tensorwise product took 14.8 s where the emulation takes 12 ms
(a 1,024 × 256 × 704 product, torch 2.13, one thread), which would put float8 out of the CPU tests' reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FP8_MODES = ("none", "tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGNMENT = 16
"""cuBLAS's FP8 products need every dimension a multiple of this."""
_AMAX_FLOOR = 1e-12
"""An all-zero operand gets this amax (torchao's EPS), so its scale stays finite."""


@dataclass(frozen=True)
class Float8Recipe:
    """How a layer's products are cast: ``rowwise`` or tensorwise, and whether ``torch._scaled_mm`` is
    replaced by its exact emulation (off CUDA)."""

    rowwise: bool
    emulate: bool = False


def recipe_for(mode: str, device_type: str) -> Float8Recipe | None:
    """``precision.fp8``'s recipe on ``device_type`` (``cuda``: ``torch._scaled_mm``; elsewhere its
    emulation); None for ``none``."""
    if mode not in FP8_MODES:
        raise ValueError(f"fp8 mode must be one of {FP8_MODES}, got {mode!r}")
    if mode == "none":
        return None
    return Float8Recipe(rowwise=mode == "rowwise", emulate=device_type != "cuda")


def _scale(t: torch.Tensor, dim: int | None, dtype: torch.dtype, groups: Sequence[Any],
           power_of_two: bool) -> torch.Tensor:
    """fp32 scale(s) taking ``t``'s absolute maximum (over ``dim``, kept as size 1; over everything when None),
    all-reduced over each of ``groups`` that is not None (the maximum over their product), to ``dtype``'s
    largest value."""
    if dim is None:
        amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)
    else:
        amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)
    for group in groups:
        if group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = torch.finfo(dtype).max / amax.clamp(min=_AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def _cast(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` times ``scale`` in fp32, saturated to ``dtype``'s range, in ``dtype``."""
    limit = torch.finfo(dtype).max
    return torch.mul(t, scale).clamp_(-limit, limit).to(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _product(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
             out_dtype: torch.dtype, recipe: Float8Recipe, fast_accum: bool) -> torch.Tensor:
    """a @ b / (a_scale · b_scale) from float8 ``a`` [m, k] (row-major) and ``b`` [k, n] (column-major), whose
    scales are [m, 1] and [1, n] (rowwise) or scalars."""
    a_inverse, b_inverse = a_scale.reciprocal(), b_scale.reciprocal()
    if recipe.emulate:
        return (torch.mm(a.float(), b.float()) * (a_inverse * b_inverse)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class _Float8Linear(torch.autograd.Function):
    """y = x Wᵀ with float8 products (module docstring). ``k_group`` / ``n_group``: the tensor group when
    K (row-parallel) or N (column-parallel) is split over it; ``m_group``: the context group when the
    tokens M are; ``replica_rows``: (rows, group) blocks of W whose gradient is summed over ``group``
    (replicated key/value heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, k_group: Any, n_group: Any,
                m_group: Any, replica_rows: tuple):
        x2 = x.reshape(-1, x.shape[-1])
        # rowwise, each of W's rows is over K and each of x's rows (one token) too; tensorwise, all of W,
        # split over K or N, and all of x, split over K and M
        weight_group = k_group if recipe.rowwise or k_group is not None else n_group
        dim = -1 if recipe.rowwise else None
        x_scale = _scale(x2, dim, E4M3, (k_group,) if recipe.rowwise else (k_group, m_group), recipe.rowwise)
        w_scale = _scale(weight, dim, E4M3, (weight_group,), recipe.rowwise)
        y = _product(_cast(x2, x_scale, E4M3), _cast(weight, w_scale, E4M3).t(), x_scale,
                     w_scale.t() if recipe.rowwise else w_scale, x.dtype, recipe, fast_accum=True)
        ctx.save_for_backward(x, weight, x_scale, w_scale)
        ctx.recipe, ctx.groups, ctx.replica_rows = recipe, (k_group, n_group, m_group), replica_rows
        # not a view (as F.linear's output is not): the row-parallel exit all-reduces it in place
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, x_scale, w_scale = ctx.saved_tensors
        recipe, (k_group, n_group, m_group) = ctx.recipe, ctx.groups
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        if recipe.rowwise:
            g_rows = _scale(g2, -1, E4M3, (n_group,), True)  # [M, 1], over N
            w_columns = _scale(weight, 0, E4M3, (n_group,), True)  # [1, K], over N
            grad_x = _product(_cast(g2, g_rows, E4M3), _column_major(_cast(weight, w_columns, E4M3)), g_rows,
                              w_columns, x.dtype, recipe, fast_accum=False)
            g_columns = _scale(g2, 0, E4M3, (m_group,), True)  # [1, N], over M
            x_columns = _scale(x2, 0, E4M3, (m_group,), True)  # [1, K], over M
            grad_weight = _product(_cast(g2, g_columns, E4M3).t().contiguous(),
                                   _column_major(_cast(x2, x_columns, E4M3)), g_columns.t(), x_columns,
                                   weight.dtype, recipe, fast_accum=False)
        else:
            g_scale = _scale(g2, None, E5M2, (n_group, m_group), False)
            g8 = _cast(g2, g_scale, E5M2)
            grad_x = _product(g8, _column_major(_cast(weight, w_scale, E4M3)), g_scale, w_scale, x.dtype, recipe,
                              fast_accum=False)
            grad_weight = _product(g8.t().contiguous(), _column_major(_cast(x2, x_scale, E4M3)), g_scale, x_scale,
                                   weight.dtype, recipe, fast_accum=False)
        for rows, group in ctx.replica_rows:
            dist.all_reduce(grad_weight[rows], group=group)  # a block of rows is contiguous: reduced in place
        return grad_x.view_as(x), grad_weight, None, None, None, None, None


def fits_float8(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether every dimension of x Wᵀ (tokens, output and input features) is a multiple of ``ALIGNMENT``."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return all(size % ALIGNMENT == 0 and size > 0 for size in (tokens, *weight.shape))


def float8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, *, k_group: Any = None,
                  n_group: Any = None, m_group: Any = None,
                  replica_rows: Sequence[tuple[slice, Any]] = ()) -> torch.Tensor:
    """``F.linear(x, weight)`` computed with float8 products (``recipe``; the shapes must pass
    ``fits_float8``); ``k_group`` / ``n_group`` is the tensor group when this rank holds part of the input
    (row-parallel) or output features (column-parallel), ``m_group`` the context group when it holds part
    of the tokens, None otherwise; ``replica_rows`` as in ``mappings.linear_summing_replica_grads``."""
    return _Float8Linear.apply(x, weight, recipe, k_group, n_group, m_group, tuple(replica_rows))
