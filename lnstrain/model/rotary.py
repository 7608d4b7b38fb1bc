"""Rotary position embeddings (rotate-half layout, as Hugging Face LLaMA)."""

from __future__ import annotations

import torch
from torch import nn


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

    def _tables(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self.cos_cached
        if cached is None or cached.shape[0] < seq_len or cached.device != device or cached.dtype != dtype:
            exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
            inv_freq = 1.0 / (self.theta ** exponents)
            angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            self.cos_cached, self.sin_cached = angles.cos().to(dtype), angles.sin().to(dtype)
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k, shaped [batch, heads, seq, head_dim], by their positions 0..seq-1."""
        cos, sin = self._tables(q.shape[-2], q.device, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
