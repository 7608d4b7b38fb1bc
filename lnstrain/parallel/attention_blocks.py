"""Attention of a block of queries over a block of keys, with the log-sum-exp that merges blocks.

Ring attention (``ring_attention``) computes attention over keys it receives a block at a time. Each
block gives an output ``o_b`` normalised over its own keys and the log-sum-exp ``l_b`` of its scores;
blocks merge exactly as ``l = log(sum_b exp(l_b))``, ``o = sum_b exp(l_b - l) o_b``. Backward needs,
per block, only the final ``o`` and ``l``: with ``P = exp(q kᵀ·scale - l)`` and ``D = rowsum(dO ∘ o)``,

    dV = Pᵀ dO,   dS = P ∘ (dO Vᵀ - D),   dQ = dS K · scale,   dK = dSᵀ Q · scale

which is FlashAttention's backward given the final statistics. Shapes: q [b, hq, sq, d], k and v
[b, hkv, sk, d] (grouped-query attention: query head i reads key/value head i // (hq / hkv), as SDPA's
``enable_gqa``); ``causal`` only for a block against itself (equal positions, top-left aligned).

Two implementations of the same arithmetic:

* ``reference``: plain fp32 matrix products, any device, query rows in tiles of ``TILE_ROWS`` so that
  at most a tile's scores exist at once. The CPU path, and what the tests exercise.
* ``flash``: torch's FlashAttention kernels (``aten._scaled_dot_product_flash_attention`` and its
  backward, which return and take the log-sum-exp), on CUDA in bf16/fp16. Used on a device only after
  it has matched the reference on a small case there (``flash_matches_reference``, once per process);
  otherwise the reference runs, with a warning. ``tests/gpu`` checks it against the reference.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

logger = logging.getLogger(__name__)

TILE_ROWS = 1024
"""Query rows per tile of the reference path: its transient scores are tile × keys fp32 values per head."""


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, hq, s, d] -> [b, hkv, hq / hkv, s, d], the query heads of each key/value head together."""
    b, heads, s, d = x.shape
    return x.reshape(b, kv_heads, heads // kv_heads, s, d)


def _scores(q_tile: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, row_offset: int) -> torch.Tensor:
    """fp32 scores [b, hkv, g, rows, sk] of a tile of grouped queries starting at row ``row_offset``."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q_tile, k) * scale
    if causal:
        rows = torch.arange(row_offset, row_offset + q_tile.shape[-2], device=q_tile.device).unsqueeze(-1)
        future = torch.arange(k.shape[-2], device=q_tile.device).unsqueeze(0) > rows
        scores.masked_fill_(future, float("-inf"))
    return scores


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp32 [b, hq, sq, d], log-sum-exp fp32 [b, hq, sq]) in plain fp32 arithmetic."""
    kv_heads = k.shape[1]
    q32, k32, v32 = _grouped(q.float(), kv_heads), k.float(), v.float()
    out = torch.empty_like(q32)
    lse = torch.empty(q32.shape[:-1], dtype=torch.float32, device=q.device)
    for start in range(0, q32.shape[-2], TILE_ROWS):
        rows = slice(start, start + TILE_ROWS)
        scores = _scores(q32[..., rows, :], k32, scale, causal, start)
        tile_lse = torch.logsumexp(scores, dim=-1)
        lse[..., rows] = tile_lse
        out[..., rows, :] = torch.einsum("bhgqk,bhkd->bhgqd", scores.sub_(tile_lse.unsqueeze(-1)).exp_(), v32)
    return out.flatten(1, 2), lse.flatten(1, 2)


def reference_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq [b, hq, sq, d], dk, dv [b, hkv, sk, d]) of one block, given the final output and log-sum-exp."""
    kv_heads = k.shape[1]
    q32, k32, v32 = _grouped(q.float(), kv_heads), k.float(), v.float()
    grad32, out32 = _grouped(grad_out.float(), kv_heads), _grouped(out.float(), kv_heads)
    lse32 = lse.float().reshape(q32.shape[:-1])
    dq = torch.empty_like(q32)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    for start in range(0, q32.shape[-2], TILE_ROWS):
        rows = slice(start, start + TILE_ROWS)
        probs = _scores(q32[..., rows, :], k32, scale, causal, start).sub_(lse32[..., rows].unsqueeze(-1)).exp_()
        grad_tile = grad32[..., rows, :]
        dv += torch.einsum("bhgqk,bhgqd->bhkd", probs, grad_tile)
        delta = (grad_tile * out32[..., rows, :]).sum(dim=-1, keepdim=True)
        grad_scores = probs.mul_(torch.einsum("bhgqd,bhkd->bhgqk", grad_tile, v32).sub_(delta))
        dq[..., rows, :] = torch.einsum("bhgqk,bhkd->bhgqd", grad_scores, k32) * scale
        dk += torch.einsum("bhgqk,bhgqd->bhkd", grad_scores, q32[..., rows, :]) * scale
    return dq.flatten(1, 2), dk, dv


# --- FlashAttention's kernels (CUDA) ---------------------------------------------------------------------------
def _expanded(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to one per query head (the kernels' own layout)."""
    copies = heads // x.shape[1]
    return x if copies == 1 else x.repeat_interleave(copies, dim=1)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [b, hq, sq, d] in q's dtype, log-sum-exp fp32 [b, hq, sq]) from
    ``aten._scaled_dot_product_flash_attention``."""
    heads = q.shape[1]
    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _expanded(k, heads), _expanded(v, heads), 0.0, causal, False, scale=scale)
    return result[0], result[1]


def flash_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference_backward`` by ``aten._scaled_dot_product_flash_attention_backward``. dk and dv summed over
    each key/value head's query heads.

    Of what the forward kernel returns besides, the backward reads nothing without dropout: the dense
    kernel takes no cumulative sequence lengths (undefined, as the forward returns them), and the random
    state (seed and offset) is read only when dropout is on, so empty stand-ins are passed; nothing but
    tensors then crosses the ring's operators. ``flash_matches_reference`` checks this form on the device
    before any ring uses it."""
    heads, kv_heads = q.shape[1], k.shape[1]
    no_random_state = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, _expanded(k, heads), _expanded(v, heads), out, lse.contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, causal, no_random_state, no_random_state, scale=scale)
    if heads != kv_heads:
        b, _, sk, d = dk.shape
        dk = dk.reshape(b, kv_heads, heads // kv_heads, sk, d).sum(dim=2)
        dv = dv.reshape(b, kv_heads, heads // kv_heads, sk, d).sum(dim=2)
    return dq, dk, dv


def flash_supports(q: torch.Tensor) -> bool:
    """Whether FlashAttention's kernels take ``q``'s device, dtype and head size."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


@functools.lru_cache(maxsize=None)
def flash_matches_reference(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the flash path runs on ``device`` and agrees with the reference in ``dtype`` (forward and
    backward, causal and not, grouped-query heads), within that dtype's rounding."""
    generator = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 1, 4, 2, 64, 64

    def model_layout(heads: int) -> torch.Tensor:  # [b, s, heads, d] memory, as the projections give it
        return torch.randn(b, s, heads, d, generator=generator).to(device, dtype).transpose(1, 2)

    q, k, v, grad = model_layout(hq), model_layout(hkv), model_layout(hkv), model_layout(hq)
    scale = 1 / math.sqrt(d)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 5e-3
    half = slice(s // 2, None)
    try:  # the ring's three kinds of block: its own (causal), early keys, late queries
        for causal, rows, keys in ((True, slice(None), slice(None)), (False, slice(None), slice(None, s // 2)),
                                   (False, half, slice(None))):
            block = (q[:, :, rows], k[:, :, keys], v[:, :, keys])
            out, lse = flash_forward(*block, causal, scale)
            ref_out, ref_lse = reference_forward(*block, causal, scale)
            grads = flash_backward(grad[:, :, rows], *block, out, lse, causal, scale)
            ref_grads = reference_backward(grad[:, :, rows], *block, out, lse, causal, scale)
            pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)]
            worst = max(float((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-6)) for a, b in pairs)
            if not worst < tolerance:
                logger.warning("ring attention: FlashAttention's kernels differ from the reference by %.2e (relative) "
                               "in %s on %s; using the reference kernels", worst, dtype, device)
                return False
    except Exception as error:  # a kernel or driver failure of any kind: the reference still works
        logger.warning("ring attention: FlashAttention's kernels failed on %s in %s (%s: %s); using the reference "
                       "kernels", device, dtype, type(error).__name__, error)
        return False
    return True


def uses_flash(q: torch.Tensor) -> bool:
    """Whether ring attention computes ``q``'s blocks with FlashAttention's kernels."""
    return flash_supports(q) and flash_matches_reference(q.device, q.dtype)
