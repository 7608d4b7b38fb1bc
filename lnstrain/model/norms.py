"""RMSNorm and LayerNorm with a constant output multiplier folded into the gain.

y = normalize(x) * (weight * output_scale) (+ bias * output_scale): the multiplier costs an
O(hidden) op on the weight, nothing per activation (``kernels.rms_norm`` applies it inside its
forward and backward, without an autograd node of its own). `output_scale` is a plain float
attribute (LNS uses it), never a parameter or buffer.

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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5, output_scale: float = 1.0, gain_init: float = 1.0) -> None:
        super().__init__()
        self.eps = eps
        self.output_scale = float(output_scale)
        self.gain_init = float(gain_init)
        self.weight = nn.Parameter(torch.full((size,), self.gain_init))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        fused_on_cuda = x.is_cuda and (fused_rms_norm_affine is not None or (
            TORCH_FUSED_RMS_NORM_ON_CUDA and weight.dtype == x.dtype))  # else torch falls back unfused
        if not fused_on_cuda:
            return rms_norm(x, weight, self.eps, self.output_scale)  # the factor inside the function
        gain = weight * self.output_scale if self.output_scale != 1.0 else weight
        if fused_rms_norm_affine is not None:
            return fused_rms_norm_affine(x, gain, weight.shape, self.eps)
        return F.rms_norm(x, weight.shape, gain, self.eps)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.gain_init)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, output_scale={self.output_scale:.6g}"


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5, output_scale: float = 1.0, gain_init: float = 1.0) -> None:
        super().__init__()
        self.eps = eps
        self.output_scale = float(output_scale)
        self.gain_init = float(gain_init)
        self.weight = nn.Parameter(torch.full((size,), self.gain_init))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else bias
        if self.output_scale != 1.0:
            weight, bias = weight * self.output_scale, bias * self.output_scale
        return F.layer_norm(x, weight.shape, weight, bias, self.eps)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.gain_init)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, output_scale={self.output_scale:.6g}"


def build_norm(cfg: ModelConfig, output_scale: float = 1.0, gain_init: float = 1.0) -> RMSNorm | LayerNorm:
    norm_class = RMSNorm if cfg.norm_type == "rmsnorm" else LayerNorm
    return norm_class(cfg.hidden_size, cfg.norm_eps, output_scale, gain_init)
