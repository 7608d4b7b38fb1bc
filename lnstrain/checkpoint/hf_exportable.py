"""Whether a model can be written as a plain Hugging Face LLaMA, read from the model's own layout.

Every layer's ``norm_schemes.block_layout`` (what ``TransformerBlock`` follows) is checked field by
field, allowing only what LLaMA's block can compute: Pre-LN placement, a plain residual, no
LayerScale, the per-layer factors ``lns_fold`` folds into weights, and initial values (nothing to
express once trained). Anything else, including a ``BlockLayout`` field this module does not know,
is refused with a message naming the scheme and what LLaMA lacks, so a new scheme is never exported
without part of what it computes.
"""

from __future__ import annotations

import dataclasses

from lnstrain.checkpoint.lns_fold import fold_problems
from lnstrain.model import norm_schemes
from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.norm_schemes import BlockLayout, Placement

_SCHEME_NAMES = {NormScheme.PRE_LN: "Pre-LN", NormScheme.LNS: "LNS", NormScheme.POST_LN: "Post-LN",
                 NormScheme.DEEPNORM: "DeepNorm", NormScheme.MIX_LN: "Mix-LN",
                 NormScheme.SANDWICH_LN: "Sandwich-LN", NormScheme.LAYERSCALE: "LayerScale"}
"""How messages name a scheme; one missing here is named by its config value."""

_LAYOUT_FIELDS_CHECKED = {"placement", "residual_scale", "layerscale_init"}
_LAYOUT_FIELDS_FOLDED = {"norm_output_scale", "sublayer_output_scale"}  # lns_fold.layer_factors
_LAYOUT_FIELDS_INITIAL_VALUES = {"norm_gain_init"}  # where a trained weight started: nothing to express

# An obstacle: (said of the whole model, said of some of its layers, with {layers}).
_POST = ("normalises after the residual add (norm(x + f(x))); LLaMA's blocks are Pre-LN",
         "are Post-LN (norm(x + f(x)) in layers {layers}); LLaMA's blocks are all Pre-LN")
_POST_SCALED = ("is Post-LN with an up-weighted residual (norm(alpha * x + f(x))); LLaMA's blocks are Pre-LN",
                "are Post-LN with an up-weighted residual (norm(alpha * x + f(x)) in layers {layers}); "
                "LLaMA's blocks are all Pre-LN")
_SANDWICH = ("normalises each sublayer's output too; LLaMA has no such norm",
             "normalise each sublayer's output too (layers {layers}); LLaMA has no such norm")
_LAYERSCALE = ("multiplies each sublayer's output by a learned per-channel gain; LLaMA has no such parameter",
               "multiply each sublayer's output by a learned per-channel gain (layers {layers}); "
               "LLaMA has no such parameter")
_SCALED_RESIDUAL = ("scales the residual branch (alpha * x + ...); LLaMA adds it as it is",
                    "scale the residual branch (alpha * x + ..., layers {layers}); LLaMA adds it as it is")


def _layout_obstacles(layout: BlockLayout) -> list[tuple[str, str]]:
    """What in one layer's layout a LLaMA block cannot compute (its norm factors it can: they are folded)."""
    obstacles = []
    if layout.placement == Placement.POST:
        obstacles.append(_POST_SCALED if layout.residual_scale != 1.0 else _POST)
    elif layout.residual_scale != 1.0:
        obstacles.append(_SCALED_RESIDUAL)
    if layout.placement == Placement.SANDWICH:
        obstacles.append(_SANDWICH)
    elif layout.placement not in (Placement.PRE, Placement.POST):
        placement = Placement(layout.placement).value
        obstacles.append((f"places its norms {placement}; LLaMA's blocks are Pre-LN",
                          f"place their norms {placement} (layers {{layers}}); LLaMA's blocks are all Pre-LN"))
    if layout.layerscale_init is not None:
        obstacles.append(_LAYERSCALE)
    known = _LAYOUT_FIELDS_CHECKED | _LAYOUT_FIELDS_FOLDED | _LAYOUT_FIELDS_INITIAL_VALUES
    for field in dataclasses.fields(layout):
        if field.name not in known and getattr(layout, field.name) != field.default:
            unknown = f"BlockLayout.{field.name}, which the Hugging Face export does not know how to express"
            obstacles.append((f"sets {unknown}", f"set {unknown} (layers {{layers}})"))
    return obstacles


def _number_ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _block_problems(cfg: ModelConfig) -> list[str]:
    """What in ``cfg``'s blocks (read from ``block_layout``, as the model reads them) LLaMA cannot compute."""
    scheme = NormScheme(cfg.norm_scheme)
    name = _SCHEME_NAMES.get(scheme, scheme.value)
    layers_by_obstacle: dict[tuple[str, str], list[int]] = {}
    for number in range(1, cfg.num_layers + 1):
        for obstacle in _layout_obstacles(norm_schemes.block_layout(cfg, number)):
            layers_by_obstacle.setdefault(obstacle, []).append(number)
    reasons = []
    for (of_every_layer, of_some_layers), layers in layers_by_obstacle.items():
        if len(layers) == cfg.num_layers:
            reasons.append(f"{name} {of_every_layer}")
        else:
            first = layers == list(range(1, len(layers) + 1))
            reasons.append(f"{name}'s {'first ' if first else ''}layers "
                           + of_some_layers.format(layers=_number_ranges(layers)))
    if not reasons and not norm_schemes.has_final_norm(scheme):
        reasons.append(f"{name} has no final norm; LLaMA ends in one (model.norm)")
    return reasons + [f"{name} {problem}" for problem in fold_problems(cfg)]


def export_problems(cfg: ModelConfig) -> list[str]:
    """Why this model cannot be written as a plain Hugging Face LLaMA (empty when it can)."""
    scheme = NormScheme(cfg.norm_scheme)
    problems = []
    reasons = _block_problems(cfg)
    if reasons:
        exportable = [s.value for s in NormScheme if not _block_problems(dataclasses.replace(cfg, norm_scheme=s))]
        problems.append(f"model.norm_scheme={scheme.value} cannot be exported as a Hugging Face LLaMA: "
                        f"{'; '.join(reasons)}. Exportable schemes for this model: {', '.join(exportable)} "
                        "(with or without scaled_init); use tools/consolidate_checkpoint.py for a plain "
                        "lnstrain state dict instead")
    if cfg.norm_type != "rmsnorm":
        problems.append(f"model.norm_type={cfg.norm_type} cannot be exported: LLaMA uses RMSNorm "
                        "(no mean subtraction, no bias)")
    return problems
