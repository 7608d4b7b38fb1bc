"""How a run is split across devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CONTEXT_METHODS = ("ring", "all_to_all")

@dataclass
class ParallelConfig:
    """The parallel layout. The data-parallel size follows from the world size: world / (tensor × pipeline
    × context).

    Attributes:
        tensor: Megatron tensor-parallel size (attention heads and MLP split across ranks).
        pipeline: pipeline-parallel stages (DeepSpeed ``PipelineModule``).
        sequence_parallel: shard norms and dropout along the sequence inside the tensor group.
        zero_stage: DeepSpeed ZeRO stage 0–3 over the data-parallel group (at most 1 with pipelines).
        pipeline_partition: how layers are split into stages: ``parameters`` (balance parameter
            counts), ``uniform`` (balance layer counts) or ``type:REGEX`` (balance layers whose class
            name matches).
        pipeline_boundaries: explicit stage boundaries as transformer-layer counts per stage, e.g.
            ``[2, 4]`` puts layers 1–2 on stage 0 and 3–6 on stage 1; overrides ``pipeline_partition``.
        context: context-parallel size N: each sequence is cut into 2N chunks and rank i of the context
            group holds chunks i and 2N-1-i (causal load balance); attention is exact across the cut,
            the other layers never see it (docs/parallelism.md, "Context parallelism").
        context_method: ``ring`` (keys and values passed around the context group, partial results
            merged through their log-sum-exp) or ``all_to_all`` (DeepSpeed-Ulysses: the sequence
            gathered and the heads split for attention, needs the heads per tensor rank divisible by N).
    """

    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    zero_stage: Literal[0, 1, 2, 3] = 1
    pipeline_partition: str = "parameters"
    pipeline_boundaries: list[int] | None = None
    context: int = 1
    context_method: Literal["ring", "all_to_all"] = "ring"

    def validate(self) -> list[str]:
        problems = []
        if self.tensor < 1:
            problems.append(f"parallel.tensor must be >= 1 (got {self.tensor})")
        if self.pipeline < 1:
            problems.append(f"parallel.pipeline must be >= 1 (got {self.pipeline})")
        if self.context < 1:
            problems.append(f"parallel.context must be >= 1 (got {self.context})")
        if self.context_method not in CONTEXT_METHODS:
            problems.append(f"parallel.context_method must be one of {', '.join(CONTEXT_METHODS)} "
                            f"(got {self.context_method!r})")
        if self.pipeline > 1 and self.zero_stage > 1:
            problems.append(f"parallel.zero_stage {self.zero_stage} cannot be combined with pipeline "
                            f"parallelism (DeepSpeed supports ZeRO-0/1 with pipelines); set "
                            f"parallel.zero_stage: 1 or parallel.pipeline: 1")
        if self.sequence_parallel and self.tensor == 1:
            problems.append("parallel.sequence_parallel needs parallel.tensor > 1")
        if self.pipeline_partition not in ("parameters", "uniform") and not self.pipeline_partition.startswith("type:"):
            problems.append(f"parallel.pipeline_partition must be 'parameters', 'uniform' or "
                            f"'type:REGEX' (got {self.pipeline_partition!r})")
        if self.pipeline_boundaries is not None:
            if len(self.pipeline_boundaries) != self.pipeline:
                problems.append(f"parallel.pipeline_boundaries has {len(self.pipeline_boundaries)} entries "
                                f"but parallel.pipeline is {self.pipeline}; give one layer count per stage")
            if any(n < 1 for n in self.pipeline_boundaries):
                problems.append("parallel.pipeline_boundaries: every stage needs at least one layer")
        return problems


def world_size_problems(world_size: int, tensor: int, pipeline: int, context: int = 1) -> list[str]:
    """The world must split into whole tensor × pipeline × context grids (sizes below 1: the parallel
    section's problem)."""
    if tensor < 1 or pipeline < 1 or context < 1 or world_size % (tensor * pipeline * context) == 0:
        return []
    if context == 1:
        return [f"world size {world_size} is not divisible by parallel.tensor × parallel.pipeline ({tensor} × "
                f"{pipeline}); launch a multiple of {tensor * pipeline} ranks"]
    return [f"world size {world_size} is not divisible by parallel.tensor × parallel.pipeline × parallel.context "
            f"({tensor} × {pipeline} × {context}); launch a multiple of {tensor * pipeline * context} ranks"]
