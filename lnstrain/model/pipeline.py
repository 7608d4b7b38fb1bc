"""The model as a DeepSpeed ``PipelineModule``: embedding, L transformer layers, output head.

Every transformer layer spec carries its global 1-based number ``ℓ`` (docs/architecture.md, "Layer
numbering"), so LayerNorm Scaling's 1/√ℓ never depends on the split. DeepSpeed's layer indices count every entry::

    untied:  0 EmbeddingStage | 1..L TransformerBlock(ℓ = 1..L) | L+1 OutputStage
    tied:    0 EmbeddingStage* | 1..L TransformerBlock | L+1 FinalNormStage | L+2 EmbeddingStage* (logits)

(* one ``TiedLayerSpec``: the first and last stage each hold a copy of the embedding, whose
gradients DeepSpeed all-reduces between them.) Micro-batches travel as ``(tokens, (labels,
weights))``: tokens to the first stage, labels and loss weights to the last, whose loss is
``model.loss.weighted_token_loss``, as without a pipeline. ``model.build.build_model`` is the entry
point (it applies activation checkpointing and compilation to the stage this file builds).

DeepSpeed's grid has no context axis: its data axis holds data × context (``parallel.groups``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from lnstrain.deepspeed_adapter import pipeline_grid_ranks, pipeline_module
from lnstrain.model.block import TransformerBlock
from lnstrain.model.config import ModelConfig
from lnstrain.model.loss import weighted_token_loss
from lnstrain.model.transformer import EmbeddingStage, OutputStage
from lnstrain.parallel.config import ParallelConfig
from lnstrain.parallel.layers import vocab_parallel_logits

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups

TIED_EMBEDDING_KEY = "word_embeddings"


class FinalNormStage(OutputStage):
    """Tied embeddings: the output stage's final norm; the tied embedding entry computes the logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.normalize(hidden)


def tied_embedding_logits(embedding: EmbeddingStage, hidden: torch.Tensor) -> torch.Tensor:
    """The last stage's use of the tied embedding: this rank's vocabulary logits."""
    return vocab_parallel_logits(hidden, embedding.word_embeddings.weight, embedding.word_embeddings.groups)


class PipelineLoss:
    """DeepSpeed's ``loss_fn(outputs, labels)``: weighted token loss of one micro-batch."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        self.cfg = cfg
        self.groups = groups
        self.__name__ = "weighted_token_loss"

    def __call__(self, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        targets, weights = labels
        return weighted_token_loss(logits, targets, weights, self.cfg, self.groups)


def layer_specs(cfg: ModelConfig, groups: ParallelGroups) -> list[LayerSpec]:
    """The model's pipeline entries, in order (see the module docstring for the indices)."""
    blocks = [LayerSpec(TransformerBlock, cfg, number, groups) for number in range(1, cfg.num_layers + 1)]
    if not cfg.tie_embeddings:
        return [LayerSpec(EmbeddingStage, cfg, groups), *blocks, LayerSpec(OutputStage, cfg, groups)]
    weight = "word_embeddings.weight"
    return [TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingStage, cfg, groups, tied_weight_attr=weight),
            *blocks,
            LayerSpec(FinalNormStage, cfg, groups),
            TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingStage, cfg, groups, tied_weight_attr=weight,
                          forward_fn=tied_embedding_logits)]


def explicit_parts(layers_per_stage: list[int], num_specs: int) -> list[int]:
    """DeepSpeed's stage start indices for ``layers_per_stage`` transformer layers per stage.

    The first stage also gets the embedding; the last stage the final norm and head.
    E.g. ``[2, 4]`` with 6 layers, untied (8 entries) -> ``[0, 3, 8]``.
    """
    parts = [0]
    for count in layers_per_stage[:-1]:
        parts.append(parts[-1] + count + (1 if len(parts) == 1 else 0))
    parts.append(num_specs)
    return parts


def check_grid_matches(module: PipelineModule, groups: ParallelGroups) -> None:
    """Assert that DeepSpeed's pipeline grid puts this rank in the same groups as ours."""
    grid = pipeline_grid_ranks(module)
    ours = {"pipe": list(groups.pp_ranks), "data": list(groups.dcp_ranks), "model": list(groups.tp_ranks)}
    theirs = {"pipe": grid.pipe, "data": grid.data, "model": grid.model}
    assert ours == theirs, f"DeepSpeed's pipeline grid {theirs} differs from lnstrain's groups {ours}"
    assert grid.stage == groups.pp_rank, (grid.stage, groups.pp_rank)


def build_pipeline_module(model_cfg: ModelConfig, parallel_cfg: ParallelConfig,
                          groups: ParallelGroups) -> PipelineModule:
    """This rank's pipeline stage of the model, partitioned as ``parallel_cfg`` asks.

    ``groups`` must hold every group the model needs, and DeepSpeed's communication layer must be
    started (``ParallelGroups.build`` does both); the ``PipelineModule`` itself builds DeepSpeed's
    grid, checked here against ``groups``.
    """
    problems = model_cfg.validate(groups.tp_size)
    if model_cfg.num_layers < groups.pp_size:
        problems.append(f"model.num_layers ({model_cfg.num_layers}) is smaller than parallel.pipeline "
                        f"({groups.pp_size}); every stage needs at least one layer")
    if problems:
        raise ValueError("cannot build the pipeline:\n  " + "\n  ".join(problems))
    specs = layer_specs(model_cfg, groups)
    boundaries = parallel_cfg.pipeline_boundaries
    module = pipeline_module(
        specs, tensor=groups.tp_size, pipeline=groups.pp_size, data=groups.dcp_size,
        stage_parts=explicit_parts(boundaries, len(specs)) if boundaries else None,
        loss_fn=PipelineLoss(model_cfg, groups), partition_method=parallel_cfg.pipeline_partition,
        activation_checkpoint_interval=0)
    check_grid_matches(module, groups)
    return module
