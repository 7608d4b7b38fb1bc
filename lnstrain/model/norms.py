"""RMSNorm and LayerNorm with a constant output multiplier folded into the gain.

y = normalize(x) * (weight * output_scale) (+ bias * output_scale): the multiplier costs an
O(hidden) op on the weight, nothing per activation (``kernels.rms_norm`` applies it inside its
forward and backward, without an autograd node of its own). `output_scale` is a plain float
attribute (LNS uses it), never a parameter or buffer.

The forward multiplies by ``OutputScale.tensor``, the same value as an fp32 0-dim tensor on the CPU (a
scalar operand: the products are bitwise those with the float), not by the float itself: ``torch.compile``
then sees one graph input whose value it never guards, so the 1/√ℓ of every layer shares one compiled
graph (with the float, dynamo specialised a layer's graph on its value once another guard, such as a
switched kernel, had made it recompile: a graph per layer, past dynamo's recompile limit). A factor of
exactly 1 multiplies nothing (``OutputScale.applied``), as a Pre-LN norm: compiled layers have one graph
for scaled norms and one for unscaled ones (LNS's layer 1, or a factor switched to 1 by a benchmark).

RMSNorm is one call, the first of: apex's fused kernel (CUDA, apex importable); torch's fused
kernel (CUDA builds that have ``_fused_rms_norm_backward``); else ``kernels.rms_norm``, which keeps
only the input and the fp32 reciprocal RMS for backward where torch's unfused ``F.rms_norm`` keeps
two fp32 copies of the activation. All three compute x * rsqrt(mean(x^2) + eps) * gain with fp32
statistics (``kernels.rms_norm``'s forward is bitwise ``F.rms_norm``'s).

`forward(x, *params)` may be given stand-ins for the module's own parameters (same values, in
`parameters()` order): under sequence parallelism the block routes them through an autograd
function that sums their gradients over the tensor group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lnstrain.model.config import ModelConfig
from lnstrain.model.kernels import rms_norm

try:
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine
except ImportError:  # apex is optional
    fused_rms_norm_affine = None


def _has_kernel(op: str, dispatch_key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)
    except RuntimeError:  # no such op in this torch
        return False


TORCH_FUSED_RMS_NORM_ON_CUDA = _has_kernel("aten::_fused_rms_norm_backward", "CUDA")


class OutputScale:
    """A norm's constant output multiplier: the float, and the same value as an fp32 0-dim CPU tensor that
    the forward multiplies by (module docstring). Not a buffer: nothing moves, casts or saves it."""

    def __init__(self, value: float) -> None:
        self.set(value)

    def set(self, value: float) -> None:
        self.value = float(value)
        self.applied = self.value != 1.0
        self.tensor = torch.tensor(self.value, dtype=torch.float32)


class _ScaledNorm(nn.Module):
    """What RMSNorm and LayerNorm share: the gain, its initial value and the output multiplier."""

    def __init__(self, size: int, eps: float, output_scale: float, gain_init: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = OutputScale(output_scale)
        self.gain_init = float(gain_init)
        self.weight = nn.Parameter(torch.full((size,), self.gain_init))

    @property
    def output_scale(self) -> float:
        return self.scale.value

    @output_scale.setter
    def output_scale(self, value: float) -> None:
        self.scale.set(value)

    def _scaled(self, parameter: torch.Tensor) -> torch.Tensor:
        return parameter * self.scale.tensor if self.scale.applied else parameter

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, output_scale={self.output_scale:.6g}"


class RMSNorm(_ScaledNorm):
    def __init__(self, size: int, eps: float = 1e-5, output_scale: float = 1.0, gain_init: float = 1.0) -> None:
        super().__init__(size, eps, output_scale, gain_init)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        fused_on_cuda = x.is_cuda and (fused_rms_norm_affine is not None or (
            TORCH_FUSED_RMS_NORM_ON_CUDA and weight.dtype == x.dtype))  # else torch falls back unfused
        if not fused_on_cuda:  # the factor inside the function
            return rms_norm(x, weight, self.eps, self.scale.tensor if self.scale.applied else None)
        gain = self._scaled(weight)
        if fused_rms_norm_affine is not None:
            return fused_rms_norm_affine(x, gain, weight.shape, self.eps)
        return F.rms_norm(x, weight.shape, gain, self.eps)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.gain_init)


class LayerNorm(_ScaledNorm):
    def __init__(self, size: int, eps: float = 1e-5, output_scale: float = 1.0, gain_init: float = 1.0) -> None:
        super().__init__(size, eps, output_scale, gain_init)
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else bias
        return F.layer_norm(x, weight.shape, self._scaled(weight), self._scaled(bias), self.eps)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.gain_init)
        nn.init.zeros_(self.bias)


def build_norm(cfg: ModelConfig, output_scale: float = 1.0, gain_init: float = 1.0) -> RMSNorm | LayerNorm:
    norm_class = RMSNorm if cfg.norm_type == "rmsnorm" else LayerNorm
    return norm_class(cfg.hidden_size, cfg.norm_eps, output_scale, gain_init)
