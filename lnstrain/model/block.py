"""One transformer layer; its norm placement comes from `norm_schemes.block_layout`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lnstrain.model.attention import Attention
from lnstrain.model.config import ModelConfig
from lnstrain.model.init import init_weights
from lnstrain.model.mlp import SwiGLUMLP
from lnstrain.model.norm_schemes import Placement, block_layout
from lnstrain.model.norms import build_norm
from lnstrain.parallel.sequence_parallel import mark_sequence_parallel

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class LayerScale(nn.Module):
    """Learnable per-channel gain on a sublayer's output (CaiT)."""

    def __init__(self, size: int, init_value: float) -> None:
        super().__init__()
        self.init_value = init_value
        self.gain = nn.Parameter(torch.full((size,), init_value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gain, self.init_value)


class TransformerBlock(nn.Module):
    """Attention then MLP, each wrapped by the layout's norms and residual.

    Pre:      x + s * f(norm(x))            (LNS: norm's output times 1/sqrt(l), s = 1;
                                             LNS after the sublayer: s = 1/sqrt(l))
    Post:     norm(alpha * x + f(x))        (Post-LN: alpha = 1; DeepNorm: alpha = (2N)^(1/4))
    Sandwich: x + norm_out(f(norm_in(x)))
    LayerScale adds a learnable gain on f's output in the Pre placement.

    In/out: hidden states [batch, seq, hidden] (sequence-sharded under sequence parallelism).
    """

    def __init__(self, cfg: ModelConfig, layer_number: int, groups: ParallelGroups) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.init_prefix = f"layer{layer_number}"
        self.layout = block_layout(cfg, layer_number)
        self.checkpoint_activations = False

        norm_scale = self.layout.norm_output_scale
        self.attention_norm = build_norm(cfg, norm_scale)
        self.attention = Attention(cfg, groups)
        self.mlp_norm = build_norm(cfg, norm_scale)
        self.mlp = SwiGLUMLP(cfg, groups)
        sandwich = self.layout.placement == Placement.SANDWICH
        self.attention_output_norm = build_norm(cfg) if sandwich else None
        self.mlp_output_norm = build_norm(cfg) if sandwich else None
        layerscale = self.layout.layerscale_init
        self.attention_layerscale = LayerScale(cfg.hidden_size, layerscale) if layerscale else None
        self.mlp_layerscale = LayerScale(cfg.hidden_size, layerscale) if layerscale else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)

        for name, module in self.named_children():
            if name.endswith(("norm", "layerscale")) and module is not None:
                mark_sequence_parallel(module, groups)
        init_weights(self, cfg)

    @property
    def lns_factor(self) -> float:
        """The LayerNorm Scaling factor this layer applies (1.0 when the scheme has none)."""
        return self.layout.norm_output_scale * self.layout.sublayer_output_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._residual(x, self.attention, self.attention_norm, self.attention_output_norm,
                           self.attention_layerscale)
        return self._residual(x, self.mlp, self.mlp_norm, self.mlp_output_norm, self.mlp_layerscale)

    def _residual(self, x: torch.Tensor, sublayer: nn.Module, norm: nn.Module,
                  output_norm: nn.Module | None, layerscale: LayerScale | None) -> torch.Tensor:
        layout = self.layout
        if layout.placement == Placement.POST:
            residual = x * layout.residual_scale if layout.residual_scale != 1.0 else x
            return norm(residual + self.dropout(sublayer(x)))
        y = sublayer(norm(x))
        if output_norm is not None:
            y = output_norm(y)
        if layerscale is not None:
            y = layerscale(y)
        if layout.sublayer_output_scale != 1.0:
            y = y * layout.sublayer_output_scale
        return x + self.dropout(y)
