"""SwiGLU feed-forward, column-parallel in (gate and up fused), row-parallel out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lnstrain.model.config import ModelConfig
from lnstrain.parallel.layers import ColumnParallelLinear, OutputPart, RowParallelLinear

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        ffn = cfg.ffn_hidden_size
        parts = [OutputPart("gate", ffn, ffn), OutputPart("up", ffn, ffn)]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, parts, groups)
        self.down_proj = RowParallelLinear(ffn, cfg.hidden_size, groups, name="down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
