"""The norm schemes and their placement per layer: the one place where the schemes (and LNS) differ.

`NormScheme` names them (``model.norm_scheme``; `config.py` imports it from here, and this module
reads a `ModelConfig` through the `SchemeSettings` protocol, without importing it). `block_layout(cfg, layer_number)` turns the config's
`norm_scheme` into a small, plain description of one block; `TransformerBlock` follows it.
LayerNorm Scaling lives in `lns_factor`, called once, in `block_layout`: `lns` applies it to the
pre-sublayer norms' output, `lns_after_sublayer` to the sublayers' output, and `lns_gain_init`
only uses it as the initial value of the pre-sublayer norms' (learned) gains, so it computes the
same function as `lns` at step 0 while Adam updates those gains at full speed instead of at lr/sqrt(l).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Protocol



class NormScheme(str, enum.Enum):
    """Where the norms sit in a transformer block (see docs/model.md for the formulas)."""

    PRE_LN = "pre_ln"
    LNS = "lns"  # Pre-LN, each pre-sublayer norm's output times 1/sqrt(layer_number)
    LNS_AFTER_SUBLAYER = "lns_after_sublayer"  # Pre-LN, each sublayer's output times 1/sqrt(layer_number)
    LNS_GAIN_INIT = "lns_gain_init"  # Pre-LN, pre-sublayer norm gains start at 1/sqrt(layer_number), no factor
    POST_LN = "post_ln"
    DEEPNORM = "deepnorm"
    MIX_LN = "mix_ln"  # first floor(mix_ln_alpha * num_layers) layers Post-LN, the rest Pre-LN
    SANDWICH_LN = "sandwich_ln"
    LAYERSCALE = "layerscale"

class SchemeSettings(Protocol):
    """What the schemes read of a model's config (``ModelConfig``, which imports this module)."""

    norm_scheme: NormScheme
    num_layers: int
    mix_ln_alpha: float
    layerscale_init: float | None



class Placement(str, enum.Enum):
    PRE = "pre"            # x + f(norm(x))
    POST = "post"          # norm(alpha * x + f(x))
    SANDWICH = "sandwich"  # x + norm_out(f(norm_in(x)))


@dataclass(frozen=True)
class BlockLayout:
    """How one block (layer `layer_number`, 1-based) places its norms.

    Every sublayer (attention, MLP) is wrapped the same way.
    """

    placement: Placement
    norm_output_scale: float = 1.0
    """Multiplies the pre-sublayer norm's output (folded into its gain): LNS."""
    sublayer_output_scale: float = 1.0
    """Multiplies the sublayer's output before the residual add: LNS after the sublayer."""
    residual_scale: float = 1.0
    """Post placement only: the residual branch is alpha * x (DeepNorm)."""
    layerscale_init: float | None = None
    """Learnable per-channel gain on the sublayer output, with this initial value."""
    norm_gain_init: float = 1.0
    """Initial value of the pre-sublayer norms' gains (a starting point, not a factor applied)."""


def lns_factor(layer_number: int) -> float:
    """LayerNorm Scaling: 1/sqrt(layer_number), layer_number global and 1-based."""
    if layer_number < 1:
        raise ValueError(f"layer_number must be >= 1, got {layer_number}")
    return 1.0 / math.sqrt(layer_number)


def deepnorm_alpha(num_layers: int) -> float:
    """DeepNet, decoder-only with N layers: residual weight alpha = (2N)^(1/4)."""
    return (2 * num_layers) ** 0.25


def deepnorm_beta(num_layers: int) -> float:
    """DeepNet, decoder-only with N layers: init gain beta = (8N)^(-1/4) for v, out and FFN weights."""
    return (8 * num_layers) ** -0.25


def cait_layerscale_init(depth: int) -> float:
    """CaiT's LayerScale initial value by depth."""
    if depth <= 18:
        return 0.1
    if depth <= 24:
        return 1e-5
    return 1e-6


def num_post_ln_layers(cfg: SchemeSettings) -> int:
    """Mix-LN: the first floor(alpha * L) layers use Post-LN."""
    return math.floor(cfg.mix_ln_alpha * cfg.num_layers)


def block_layout(cfg: SchemeSettings, layer_number: int) -> BlockLayout:
    scheme = NormScheme(cfg.norm_scheme)
    if scheme in (NormScheme.LNS, NormScheme.LNS_AFTER_SUBLAYER, NormScheme.LNS_GAIN_INIT):
        factor = lns_factor(layer_number)
        if scheme == NormScheme.LNS:
            return BlockLayout(Placement.PRE, norm_output_scale=factor)
        if scheme == NormScheme.LNS_GAIN_INIT:
            return BlockLayout(Placement.PRE, norm_gain_init=factor)
        return BlockLayout(Placement.PRE, sublayer_output_scale=factor)
    if scheme == NormScheme.PRE_LN:
        return BlockLayout(Placement.PRE)
    if scheme == NormScheme.POST_LN:
        return BlockLayout(Placement.POST)
    if scheme == NormScheme.DEEPNORM:
        return BlockLayout(Placement.POST, residual_scale=deepnorm_alpha(cfg.num_layers))
    if scheme == NormScheme.MIX_LN:
        return BlockLayout(Placement.POST if layer_number <= num_post_ln_layers(cfg) else Placement.PRE)
    if scheme == NormScheme.SANDWICH_LN:
        return BlockLayout(Placement.SANDWICH)
    if scheme == NormScheme.LAYERSCALE:
        init = cfg.layerscale_init if cfg.layerscale_init is not None else cait_layerscale_init(cfg.num_layers)
        return BlockLayout(Placement.PRE, layerscale_init=init)
    raise ValueError(f"unknown norm scheme {scheme!r}")


def norms_per_block(scheme: NormScheme) -> int:
    return 4 if NormScheme(scheme) == NormScheme.SANDWICH_LN else 2


def has_final_norm(scheme: NormScheme) -> bool:
    """Post-LN and DeepNorm blocks end in a norm already, so the model has no final norm."""
    return NormScheme(scheme) not in (NormScheme.POST_LN, NormScheme.DEEPNORM)
