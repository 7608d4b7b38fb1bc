"""The model as a DeepSpeed ``PipelineModule``: embedding, L transformer layers, output head.

Every transformer layer spec carries its global 1-based number ``ℓ`` (docs/architecture.md, "Layer numbering"), so LayerNorm
Scaling's 1/√ℓ never depends on the split. DeepSpeed's layer indices count every entry::

    untied:  0 EmbeddingStage | 1..L TransformerBlock(ℓ = 1..L) | L+1 OutputStage
    tied:    0 EmbeddingStage* | 1..L TransformerBlock | L+1 FinalNormStage | L+2 EmbeddingStage* (logits)

(* one ``TiedLayerSpec``: the first and last stage each hold a copy of the embedding, whose
gradients DeepSpeed all-reduces between them.) Micro-batches travel as ``(tokens, (labels,
weights))``: tokens to the first stage, labels and loss weights to the last, whose loss is
``model.loss.weighted_token_loss``, as without a pipeline. ``model.build.build_model`` is the entry
point (it applies activation checkpointing and compilation to the stage this file builds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

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


class LnsPipelineModule(PipelineModule):
    """``PipelineModule`` with explicit stage boundaries and cheap parameter counting.

    DeepSpeed 0.19 has no explicit-boundary method, and its ``parameters`` method builds every layer
    of the whole model on every rank to count parameters; here the counting builds them on the
    meta device (shapes only, no memory, no init). Both override private DeepSpeed methods.
    """

    def __init__(self, layers: list[LayerSpec], *, stage_parts: list[int] | None = None, **kwargs) -> None:
        object.__setattr__(self, "_lnstrain_stage_parts", stage_parts)  # read during super().__init__
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if self._lnstrain_stage_parts is None:
            return super()._partition_layers(method)
        self.parts = list(self._lnstrain_stage_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _count_layer_params(self) -> list[int]:
        with torch.device("meta"):
            return super()._count_layer_params()


def check_grid_matches(module: PipelineModule, groups: ParallelGroups) -> None:
    """Assert that DeepSpeed's pipeline grid puts this rank in the same groups as ours."""
    grid = module._grid
    ours = {"pipe": list(groups.pp_ranks), "data": list(groups.dp_ranks), "model": list(groups.tp_ranks)}
    theirs = {"pipe": list(grid.pp_group), "data": list(grid.dp_group), "model": list(grid.slice_group)}
    assert ours == theirs, f"DeepSpeed's pipeline grid {theirs} differs from lnstrain's groups {ours}"
    assert grid.get_stage_id() == groups.pp_rank, (grid.get_stage_id(), groups.pp_rank)


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
    topology = PipeModelDataParallelTopology(num_pp=groups.pp_size, num_mp=groups.tp_size, num_dp=groups.dp_size)
    module = LnsPipelineModule(
        specs, topology=topology, loss_fn=PipelineLoss(model_cfg, groups),
        partition_method=parallel_cfg.pipeline_partition,
        stage_parts=explicit_parts(boundaries, len(specs)) if boundaries else None,
        activation_checkpoint_interval=0)
    check_grid_matches(module, groups)
    return module
