"""SwiGLU feed-forward, column-parallel in (gate and up in one weight), row-parallel out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lnstrain.model.config import ModelConfig
from lnstrain.model.kernels import swiglu
from lnstrain.parallel.layers import ColumnParallelLinear, OutputPart, RowParallelLinear
from lnstrain.parallel.mappings import enter_tp_region

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class GateUpLinear(ColumnParallelLinear):
    """The gate | up weight (one parameter, sharded like any column-parallel weight), applied as two
    products on its row blocks, so that silu and the product read contiguous tensors rather than
    halves of one fused output (about 1% of a CPU training step on the benchmark model; the
    gradient's halves then need no ``cat`` either). Returns (gate, up)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = enter_tp_region(x, self.groups)
        gate_weight, up_weight = self.weight.split(self.local_sizes)
        return self.product(x, gate_weight), self.product(x, up_weight)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), silu(gate) recomputed in backward (``kernels.swiglu``)."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        ffn = cfg.ffn_hidden_size
        parts = [OutputPart("gate", ffn, ffn), OutputPart("up", ffn, ffn)]
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, parts, groups)
        self.down_proj = RowParallelLinear(ffn, cfg.hidden_size, groups, name="down")
        self.triton_kernel = True
        """SwiGLU through the custom ops (the Triton kernels where usable); ``build.select_triton_kernels`` turns
        it off where the kernels cannot run, so that compiled layers fuse the plain ops there instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(swiglu(gate, up, self.triton_kernel))
