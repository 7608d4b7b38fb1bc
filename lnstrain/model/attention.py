"""Causal grouped-query self-attention with rotary embeddings, heads split across
tensor-parallel ranks.

Query heads are split evenly. Key/value heads are split too when there are at least as
many as ranks; otherwise each rank holds the one KV head its query heads use (replicated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lnstrain.model.config import ModelConfig
from lnstrain.model.rotary import RotaryEmbedding
from lnstrain.parallel.layers import ColumnParallelLinear, OutputPart, RowParallelLinear
from lnstrain.parallel.mappings import enter_tp_region

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        tp = groups.tp_size
        self.groups = groups
        self.head_dim = cfg.head_dim
        self.local_heads = cfg.num_heads // tp
        self.local_kv_heads = max(cfg.kv_heads // tp, 1)
        self.dropout = cfg.attention_dropout

        q = OutputPart("q", cfg.num_heads * cfg.head_dim, cfg.num_heads)
        k = OutputPart("k", cfg.kv_heads * cfg.head_dim, cfg.kv_heads)
        v = OutputPart("v", cfg.kv_heads * cfg.head_dim, cfg.kv_heads)
        if cfg.fused_qkv:
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, k, v], groups, input_in_region=True)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [q], groups, input_in_region=True)
            self.k_proj = ColumnParallelLinear(cfg.hidden_size, [k], groups, input_in_region=True)
            self.v_proj = ColumnParallelLinear(cfg.hidden_size, [v], groups, input_in_region=True)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, groups, name="o")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hasattr(self, "qkv_proj"):
            return self.qkv_proj(x).split(self.qkv_proj.local_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] (sequence-sharded under sequence parallelism)."""
        x = enter_tp_region(x, self.groups)
        batch, seq, _ = x.shape
        q, k, v = self._project(x)
        q = q.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.local_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, k)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.local_kv_heads != self.local_heads,
        )
        out = out.transpose(1, 2).reshape(batch, seq, self.local_heads * self.head_dim)
        return self.o_proj(out)
