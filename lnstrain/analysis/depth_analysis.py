"""One model's depth analysis: variance, angular distance, layer pruning and their summary.

`analyze_model` runs everything on a model (a single-process lnstrain `Transformer`, or any
`model_source.DepthModel`, e.g. a Hugging Face model through `hf_source`) and returns a
`DepthAnalysis`, a plain record that `report.py` writes as JSON, CSV, Markdown and plots (and reads
back for `--compare`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lnstrain.analysis.angular import AngularDistanceAccumulator, distance_by_offset
from lnstrain.analysis.model_source import DepthModel, as_depth_model
from lnstrain.analysis.progress import Progress
from lnstrain.analysis.pruning import EvalResult, LayerPruning, MultipleChoiceItem, layer_pruning
from lnstrain.analysis.representations import Batch, iterate_residual_streams
from lnstrain.analysis.variance import VarianceAccumulator
from lnstrain.analysis.windows import WindowRecord

logger = logging.getLogger(__name__)

DEFAULT_NEAR_IDENTITY_THRESHOLD = 0.01


@dataclass
class DepthSummary:
    near_identity_threshold: float
    """A layer is near-identity when skipping it changes the validation loss by less than this (|ΔP|, nats)."""
    near_identity_layers: list[int]
    deep_half_share: float
    """Share of the total ΔP (loss increases, negatives counted as 0) carried by the deepest
    floor(L / 2) layers; 0.5 would be an even spread, near 0 the Curse of Depth."""
    negative_layers: list[int] = field(default_factory=list)
    """Layers whose removal lowers the validation loss (ΔP < 0)."""

    @property
    def num_near_identity(self) -> int:
        return len(self.near_identity_layers)


@dataclass
class DepthAnalysis:
    name: str
    num_layers: int
    norm_scheme: str
    validation_tokens: int
    output_variance: list[float]
    """[embedding output, output of layer 1, ..., layer L]."""
    angular_distance: list[list[float]]
    """[L + 1, L + 1]: mean distance between the states entering layers i + 1 and j + 1 (L + 1: after the last)."""
    baseline: EvalResult
    pruning: list[LayerPruning]
    summary: DepthSummary
    norm_gains: list[list[float]] = field(default_factory=list)
    """[L][len(norm_names)]: mean |effective gain| of each of layer l's norms (the gain as the norm applies
    it, times any factor the scheme applies to the norm's output, e.g. LNS's 1/sqrt(l)); empty in older
    analyses."""
    norm_names: list[str] = field(default_factory=lambda: ["attention_norm", "mlp_norm"])
    """The role of each entry of a layer's norm_gains (model_source.DepthModel.norm_names)."""
    source: str = ""
    """What was measured: the model's kind and dtype (e.g. "Hugging Face llama, bf16"); empty in older analyses."""
    windows: WindowRecord | None = None
    """The windows measured on; None in older analyses and when the caller gave none."""

    def distance_by_offset(self) -> list[list[float | None]]:
        return distance_by_offset(torch.tensor(self.angular_distance))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["summary"]["num_near_identity"] = self.summary.num_near_identity
        data["angular_distance_by_offset"] = self.distance_by_offset()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DepthAnalysis:
        """The analysis `to_dict` wrote. The summary is computed again from the per-layer ΔP, so that an
        analysis written by an older version counts near-identity layers by today's rule."""
        pruning = [LayerPruning(**{**p, "result": EvalResult(**p["result"])}) for p in data["pruning"]]
        fields = {f.name for f in dataclasses.fields(cls)}
        windows = data.get("windows")
        return cls(**{**{k: v for k, v in data.items() if k in fields},
                      "baseline": EvalResult(**data["baseline"]), "pruning": pruning,
                      "summary": summarize(pruning, data["summary"]["near_identity_threshold"]),
                      "windows": None if windows is None else WindowRecord.from_dict(windows)})


def summarize(pruning: Sequence[LayerPruning], threshold: float = DEFAULT_NEAR_IDENTITY_THRESHOLD) -> DepthSummary:
    """Near-identity layers are those whose removal changes the loss by less than `threshold` either way:
    a layer whose removal lowers the loss by more is not an identity map, and is listed as negative."""
    near_identity = [p.layer for p in pruning if abs(p.delta_loss) < threshold]
    gains = [max(p.delta_loss, 0.0) for p in pruning]
    deep = gains[len(gains) - len(gains) // 2:]
    total = sum(gains)
    return DepthSummary(near_identity_threshold=threshold, near_identity_layers=near_identity,
                        deep_half_share=sum(deep) / total if total > 0 else 0.0,
                        negative_layers=[p.layer for p in pruning if p.delta_loss < 0])


def effective_norm_gains(model: nn.Module | DepthModel) -> list[list[float]]:
    """[L][2]: mean |gain × output scale| of each layer's attention and MLP norm."""
    return as_depth_model(model).norm_gains()


def measure_representations(model: nn.Module | DepthModel,
                            batches: Sequence[Batch]) -> tuple[list[float], list[list[float]]]:
    """(output variance per state, [L + 1, L + 1] angular distances), in one pass over the batches."""
    variance, angular = VarianceAccumulator(), AngularDistanceAccumulator()
    for _batch, states in iterate_residual_streams(model, batches):
        variance.update(states)
        angular.update(states)
    return variance.variances(), angular.matrix().tolist()


def analyze_model(model: nn.Module | DepthModel, batches: Sequence[Batch], *, name: str | None = None,
                  items: Sequence[MultipleChoiceItem] = (),
                  near_identity_threshold: float = DEFAULT_NEAR_IDENTITY_THRESHOLD,
                  windows: WindowRecord | None = None) -> DepthAnalysis:
    """Everything the depth report shows. `name` defaults to the model's (for lnstrain: its norm scheme);
    `windows`: the record of the windows `batches` holds (`eval_data.Windows`), kept with the analysis.
    Logs a progress line with an ETA after each of the L + 2 passes over the batches."""
    model = as_depth_model(model)
    name = name or model.name
    progress = Progress(name, model.num_layers + 2)
    logger.info("%s: %d layers; residual-stream variance and angular distance over %d batches, then layer "
                "pruning (%d evaluations)", name, model.num_layers, len(batches), model.num_layers + 1)
    output_variance, angular = measure_representations(model, batches)
    progress.done("residual stream")
    baseline, pruning = layer_pruning(model, batches, items, model.max_seq_len, progress=progress)
    return DepthAnalysis(name=name, num_layers=model.num_layers, norm_scheme=model.norm_scheme,
                         validation_tokens=baseline.tokens, output_variance=output_variance, angular_distance=angular,
                         baseline=baseline, pruning=pruning, summary=summarize(pruning, near_identity_threshold),
                         norm_gains=model.norm_gains(), norm_names=list(model.norm_names), source=model.source,
                         windows=windows)
