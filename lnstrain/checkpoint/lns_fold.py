"""LayerNorm Scaling folded into exported weights, the record that says so, and unfolding it exactly.

What an export folds is read from the model's own ``norm_schemes.block_layout``, layer by layer: its
``norm_output_scale`` (multiplying the pre-sublayer norms' output; ``lns``'s 1/√ℓ) is folded into
the two norm gains, its ``sublayer_output_scale`` (multiplying the sublayers' output;
``lns_after_sublayer``'s 1/√ℓ) into ``o_proj`` and ``down_proj``, so plain LLaMA code computes the
same logits. The export's ``config.json`` records it::

    "lnstrain": {"norm_scheme": "lns", "lns_folded_into": ["input_layernorm", "post_attention_layernorm"],
                 "layer_factors": [1.0, 0.7071067811865476, ...],
                 "unfolded_weights_file": "lnstrain_unfolded_norms.safetensors", "lnstrain_version": "..."}

(``layer_factors``: per layer, the factor folded into every weight named in ``lns_folded_into``; one
record holds one set of weights, so a layout with factors in both places is refused: ``fold_problems``)
and the importers (``tools/convert_from_hf.py``, ``checkpoint.init_from``) unfold when the record is
there. Multiplying by 1/√ℓ is not invertible in floating point (two neighbouring gains can round
to the same product, so dividing back recovers one of them, not always the original), so an export
that folds the norm gains also carries them as trained in a small side file (``unfolded_weights_file``,
fp32): unfolding takes a gain from it when folding it again gives the exported gain bit for bit (a file
left from before a fine-tune of the export does not), and divides otherwise. Either way the unfolded
model computes what the export computes, since the model multiplies the gain by the same factor again.
"""

from __future__ import annotations

import logging

import torch

from lnstrain import __version__
from lnstrain.model import norm_schemes
from lnstrain.model.config import ModelConfig, NormScheme

logger = logging.getLogger(__name__)

RECORD_KEY = "lnstrain"
UNFOLDED_WEIGHTS_FILE = "lnstrain_unfolded_norms.safetensors"
NORM_GAINS = ["input_layernorm", "post_attention_layernorm"]
"""Where a layout's ``norm_output_scale`` is folded."""
SUBLAYER_OUTPUTS = ["o_proj", "down_proj"]
"""Where a layout's ``sublayer_output_scale`` is folded (each sublayer's last linear map)."""


def layer_factors(cfg: ModelConfig, layer_number: int) -> tuple[float, float]:
    """(factor folded into both norm gains, factor folded into o_proj and down_proj) for layer ℓ: the
    factors the model's ``block_layout`` multiplies the norms' output and the sublayers' output by."""
    layout = norm_schemes.block_layout(cfg, layer_number)
    return layout.norm_output_scale, layout.sublayer_output_scale


def model_factors(cfg: ModelConfig) -> list[tuple[float, float]]:
    """``layer_factors`` of every layer, first to last."""
    return [layer_factors(cfg, number) for number in range(1, cfg.num_layers + 1)]


def folded_into(factors: list[tuple[float, float]]) -> list[str]:
    """The weights an export of a model with these per-layer factors multiplies (``lns_folded_into``)."""
    return ((NORM_GAINS if any(norm != 1.0 for norm, _ in factors) else [])
            + (SUBLAYER_OUTPUTS if any(output != 1.0 for _, output in factors) else []))


def fold_problems(cfg: ModelConfig) -> list[str]:
    """Why an export of ``cfg`` cannot record what it folds (empty when it can), said of its scheme."""
    if folded_into(model_factors(cfg)) == NORM_GAINS + SUBLAYER_OUTPUTS:
        return ["multiplies both the pre-sublayer norms' output and the sublayers' output by a factor; an "
                "export folds one of the two (config.json's record holds one factor per layer)"]
    return []


def fold_record(cfg: ModelConfig) -> dict:
    """What an export of ``cfg`` folded, for its config.json (key ``RECORD_KEY``)."""
    factors = model_factors(cfg)
    names = folded_into(factors)
    column = 1 if names == SUBLAYER_OUTPUTS else 0
    record = {"norm_scheme": NormScheme(cfg.norm_scheme).value, "lns_folded_into": names,
              "layer_factors": [pair[column] for pair in factors], "lnstrain_version": __version__}
    if names == NORM_GAINS:
        record["unfolded_weights_file"] = UNFOLDED_WEIGHTS_FILE
    return record


def folded_norm_gains(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The norm gains an export folds, as trained, under their Hugging Face names (the side file)."""
    if folded_into(model_factors(cfg)) != NORM_GAINS:
        return {}
    gains = {}
    for index in range(cfg.num_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        gains[theirs + "input_layernorm.weight"] = state[ours + "attention_norm.weight"].float().contiguous()
        gains[theirs + "post_attention_layernorm.weight"] = state[ours + "mlp_norm.weight"].float().contiguous()
    return gains


def unfold_factors(record: dict | None, cfg: ModelConfig, unfold: bool | None, source: str
                   ) -> list[tuple[float, float]] | None:
    """Per layer, the (norm, output) factors to divide out of ``source``'s weights, or None to load them
    as they are. ``unfold`` None: unfold when ``record`` (config.json's) says the weights hold the
    factors of this config's scheme. The decision and its consequence are logged either way."""
    scheme = NormScheme(cfg.norm_scheme)
    applies_factors = bool(folded_into(model_factors(cfg)))
    folded = NormScheme(record["norm_scheme"]) if record and record.get("lns_folded_into") else None
    if unfold is None:
        unfold = folded is not None and folded == scheme
        level, message = _automatic_decision(record, folded, scheme, applies_factors)
    elif unfold and folded is None and not applies_factors:
        unfold = False
        level, message = logging.WARNING, f"unfolding asked for, but norm_scheme={scheme.value} has no LNS factors"
    else:
        level, message = logging.INFO, f"{'unfolding' if unfold else 'not unfolding'} the LNS factors, as asked"
    logger.log(level, "%s: %s (weights %s)", source, message, "unfolded" if unfold else "loaded as they are")
    if not unfold:
        return None
    if folded is not None:  # undo exactly what the export did
        recorded = record.get("layer_factors") or []
        if len(recorded) != cfg.num_layers:
            raise ValueError(f"{source}: config.json's lnstrain.layer_factors has {len(recorded)} entries for "
                             f"{cfg.num_layers} layers")
        into_norms = record["lns_folded_into"] == NORM_GAINS
        return [(float(f), 1.0) if into_norms else (1.0, float(f)) for f in recorded]
    return model_factors(cfg)


def _automatic_decision(record: dict | None, folded: NormScheme | None, scheme: NormScheme,
                        applies_factors: bool) -> tuple[int, str]:
    override = "--unfold-lns / --no-unfold-lns, or checkpoint.init_from_unfold_lns, override this"
    twice = (f"norm_scheme={scheme.value} multiplies each layer's sublayers by its per-layer factors on top, so "
             "the model computes a different function than the checkpoint did")
    if folded is not None and folded == scheme:
        return logging.INFO, (f"config.json records that lnstrain folded {scheme.value}'s per-layer factors into "
                              f"{', '.join(record['lns_folded_into'])}; {override}")
    if folded is not None and not applies_factors:
        return logging.INFO, (f"config.json records folded {folded.value} factors; norm_scheme={scheme.value} "
                              "applies no factor, so it computes what the exported model computes")
    if folded is not None:
        return logging.WARNING, (f"config.json records folded {folded.value} factors, but norm_scheme="
                                 f"{scheme.value}: the model computes a different function than the checkpoint did")
    if not applies_factors:
        return logging.INFO, f"nothing folded, nothing to unfold into norm_scheme={scheme.value}"
    if record:
        return logging.WARNING, f"config.json records an lnstrain {record.get('norm_scheme')} export: {twice}"
    return logging.WARNING, (f"config.json has no lnstrain record of folded LNS factors: {twice} (if it is an "
                             "lnstrain LNS export from before the record existed, unfold it: --unfold-lns or "
                             "checkpoint.init_from_unfold_lns: true)")


def unfold(folded: torch.Tensor, factor: float, as_trained: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight that, multiplied by ``factor`` (as export and model do), gives ``folded``:
    ``as_trained`` when it does so bit for bit, else ``folded / factor``."""
    if factor == 1.0:
        return folded.float()
    if as_trained is not None and as_trained.shape == folded.shape and torch.equal(
            (as_trained.float() * factor).to(folded.dtype), folded):
        return as_trained.float()
    return folded.float() / factor


def record_problems(record: object, cfg: ModelConfig, unfold: bool | None, source: str) -> list[str]:
    """What makes config.json's record (``fold_record``'s shape) unusable for ``unfold_factors``; [] when
    there is no record or it is sound. ``unfold`` as for ``unfold_factors``."""
    if record is None:
        return []
    where = f"{source}: config.json's {RECORD_KEY}"
    if not isinstance(record, dict):
        return [f"{where} is {type(record).__name__}, not a mapping as lnstrain's exports write it"]
    problems = []
    schemes = [s.value for s in NormScheme]
    names = record.get("lns_folded_into")
    if names not in (None, [], NORM_GAINS, SUBLAYER_OUTPUTS):
        problems.append(f"{where}.lns_folded_into must be {NORM_GAINS} or {SUBLAYER_OUTPUTS}, the weights an "
                        f"export folds (got {names!r})")
    if names and record.get("norm_scheme") not in schemes:
        problems.append(f"{where}.norm_scheme is {record.get('norm_scheme')!r}, not one of {schemes}")
    elif names and unfold is not False:
        factors = record.get("layer_factors")
        numbers = isinstance(factors, list) and all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < float("inf") for f in factors)
        as_they_are = "; or load the weights as they are: checkpoint.init_from_unfold_lns: false"
        if not numbers:
            problems.append(f"{where}.layer_factors must be a list of positive numbers, one per layer{as_they_are}")
        elif len(factors) != cfg.num_layers:
            problems.append(f"{where}.layer_factors has {len(factors)} entries for {cfg.num_layers} layers "
                            f"(model.num_layers){as_they_are}")
    return problems
