"""One transformer layer; its norm placement comes from `norm_schemes.block_layout`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lnstrain.model.attention import Attention
from lnstrain.model.config import ModelConfig
from lnstrain.model.init import init_weights
from lnstrain.model.mlp import SwiGLUMLP
from lnstrain.model.norm_schemes import Placement, block_layout
from lnstrain.model.norms import OutputScale, build_norm
from lnstrain.parallel.sequence_parallel import sequence_parallel_params

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class LayerScale(nn.Module):
    """Learnable per-channel gain on a sublayer's output (CaiT)."""

    def __init__(self, size: int, init_value: float) -> None:
        super().__init__()
        self.init_value = init_value
        self.gain = nn.Parameter(torch.full((size,), init_value))

    def forward(self, x: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        """``gain`` stands in for ``self.gain`` (see ``norms``)."""
        return x * (self.gain if gain is None else gain)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gain, self.init_value)


class TransformerBlock(nn.Module):
    """Attention then MLP, each wrapped by the layout's norms and residual.

    Pre:      x + s * f(norm(x))            (LNS: norm's output times 1/sqrt(l), s = 1;
                                             LNS after the sublayer: s = 1/sqrt(l);
                                             LNS gain init: norm's gain starts at 1/sqrt(l))
    Post:     norm(alpha * x + f(x))        (Post-LN: alpha = 1; DeepNorm: alpha = (2N)^(1/4))
    Sandwich: x + norm_out(f(norm_in(x)))
    LayerScale adds a learnable gain on f's output in the Pre placement.

    In/out: hidden states [batch, seq, hidden] (sequence-sharded under sequence parallelism).

    Activation checkpointing (``set_activation_checkpointing``): ``full`` recomputes the whole layer
    in backward, keeping only its input; ``selective`` recomputes only the attention core.
    """

    REPLICATED = ("attention_norm", "attention_output_norm", "attention_layerscale",
                  "mlp_norm", "mlp_output_norm", "mlp_layerscale")
    """The children whose parameters are replicated over the tensor group (norms, LayerScale)."""

    def __init__(self, cfg: ModelConfig, layer_number: int, groups: ParallelGroups) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.init_prefix = f"layer{layer_number}"
        self.groups = groups
        self.layout = block_layout(cfg, layer_number)
        self.checkpoint_activations = False
        self.sublayer_scale = OutputScale(self.layout.sublayer_output_scale)  # a graph input, as a norm's (norms.py)

        norm_scale, gain_init = self.layout.norm_output_scale, self.layout.norm_gain_init
        self.attention_norm = build_norm(cfg, norm_scale, gain_init)
        self.attention = Attention(cfg, groups)
        self.mlp_norm = build_norm(cfg, norm_scale, gain_init)
        self.mlp = SwiGLUMLP(cfg, groups)
        sandwich = self.layout.placement == Placement.SANDWICH
        self.attention_output_norm = build_norm(cfg) if sandwich else None
        self.mlp_output_norm = build_norm(cfg) if sandwich else None
        layerscale = self.layout.layerscale_init
        self.attention_layerscale = LayerScale(cfg.hidden_size, layerscale) if layerscale else None
        self.mlp_layerscale = LayerScale(cfg.hidden_size, layerscale) if layerscale else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        init_weights(self, cfg)

    @property
    def lns_factor(self) -> float:
        """The LayerNorm Scaling factor this layer applies (1.0 when the scheme has none, and under
        ``lns_gain_init``, whose 1/sqrt(l) is only the gains' initial value)."""
        return self.layout.norm_output_scale * self.layout.sublayer_output_scale

    def set_activation_checkpointing(self, mode: str) -> None:
        """``none``, ``full`` (recompute the layer) or ``selective`` (recompute the attention core)."""
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"activation checkpointing must be 'none', 'full' or 'selective', got {mode!r}")
        self.checkpoint_activations = mode == "full"
        self.attention.checkpoint_core = mode == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sublayer_outputs(x)[1]

    def sublayer_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states after the attention sublayer and after the MLP sublayer (the layer's
        output), each with its norms and residual. A direct call: no hooks, no activation checkpointing."""
        # Under sequence parallelism the replicated parameters come back as stand-ins whose
        # gradients are summed over the tensor group (one all-reduce for the whole layer).
        params = sequence_parallel_params({name: getattr(self, name) for name in self.REPLICATED}, self.groups)

        def child(name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
            module = getattr(self, name)
            if name not in params:
                return module
            return lambda x: module(x, *params[name])

        after_attention = self._residual(x, self.attention, child("attention_norm"), child("attention_output_norm"),
                                         child("attention_layerscale"))
        return after_attention, self._residual(after_attention, self.mlp, child("mlp_norm"), child("mlp_output_norm"),
                                               child("mlp_layerscale"))

    def _residual(self, x: torch.Tensor, sublayer: nn.Module, norm: Callable[[torch.Tensor], torch.Tensor],
                  output_norm: Callable[[torch.Tensor], torch.Tensor] | None,
                  layerscale: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        layout = self.layout
        if layout.placement == Placement.POST:
            residual = x * layout.residual_scale if layout.residual_scale != 1.0 else x
            return norm(residual + self.dropout(sublayer(x)))
        y = sublayer(norm(x))
        if output_norm is not None:
            y = output_norm(y)
        if layerscale is not None:
            y = layerscale(y)
        if self.sublayer_scale.applied:
            y = y * self.sublayer_scale.tensor
        return x + self.dropout(y)
