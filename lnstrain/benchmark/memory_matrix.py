"""The memory estimate against measured steady steps over a matrix of sizes, precisions, ZeRO stages
and parallel layouts (``tools/measure_memory.py``).

Each point is one config plus overrides on one or two ranks; every rank builds the DeepSpeed engine
under ``PhaseMemory`` and takes a few steps on synthetic tokens. The estimate for the rank's pipeline
stage is set beside the peak of its last (steady) step; a point's ratio is the one farthest from 1
over its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lnstrain.config.run_config import Config, load_config
from lnstrain.estimate.memory import GIB, memory_estimate
from lnstrain.parallel.local_ranks import run_distributed


@dataclass(frozen=True)
class MatrixPoint:
    """One measurement: a layout name, its rank count and the config overrides that make it."""

    layout: str
    world_size: int
    overrides: tuple[str, ...]

    def label(self) -> str:
        return " ".join(self.overrides)


SINGLE_RANK = tuple(MatrixPoint("1 rank", 1, (f"precision.dtype={dtype}", f"parallel.zero_stage={zero}"))
                    for dtype in ("fp32", "bf16") for zero in (0, 1, 2, 3))
CHECKPOINTING = tuple(MatrixPoint("1 rank", 1, ("precision.dtype=bf16", "parallel.zero_stage=1",
                                                f"train.activation_checkpointing={mode}"))
                      for mode in ("selective", "full"))
TWO_RANKS = (
    MatrixPoint("data 2", 2, ("precision.dtype=fp32", "parallel.zero_stage=1")),
    MatrixPoint("data 2", 2, ("precision.dtype=bf16", "parallel.zero_stage=2")),
    MatrixPoint("data 2", 2, ("precision.dtype=bf16", "parallel.zero_stage=3")),
    MatrixPoint("tensor 2", 2, ("precision.dtype=fp32", "parallel.zero_stage=0", "parallel.tensor=2")),
    MatrixPoint("tensor 2 + SP", 2, ("precision.dtype=bf16", "parallel.zero_stage=1", "parallel.tensor=2",
                                     "parallel.sequence_parallel=true")),
    MatrixPoint("pipeline 2", 2, ("precision.dtype=fp32", "parallel.zero_stage=0", "parallel.pipeline=2")),
    MatrixPoint("pipeline 2", 2, ("precision.dtype=bf16", "parallel.zero_stage=1", "parallel.pipeline=2")),
)
POINTS = SINGLE_RANK + CHECKPOINTING + TWO_RANKS


@dataclass(frozen=True)
class PointResult:
    config: str
    point: MatrixPoint
    optimizer_kind: str
    estimated: float
    measured: float
    estimated_phase: str
    measured_phase: str

    @property
    def ratio(self) -> float:
        return self.estimated / self.measured


def point_config(path: str | Path, point: MatrixPoint, shape: list[str]) -> Config:
    """The config at ``path`` with the matrix's shape overrides (sequence, micro-batch) and the point's.
    Two micro-batches per data-parallel rank, so pipelines keep more than one in flight."""
    micro_batch = next((int(item.split("=", 1)[1]) for item in shape if item.startswith("train.micro_batch_size=")), 1)
    config = load_config(path, list(shape) + list(point.overrides), point.world_size, validate=False)
    data = max(config.data_parallel_size(point.world_size), 1)
    steps_per_rank = 2 if config.parallel.pipeline > 1 else 1
    return load_config(path, list(shape) + list(point.overrides)
                       + [f"train.global_batch_size={micro_batch * data * steps_per_rank}", "train.steps=10"],
                       point.world_size, validate=False)


def _measure_on_rank(rank: int, world_size: int, path: str, point: MatrixPoint, shape: list[str],
                     threads: int) -> tuple[int, dict[str, int]]:
    from lnstrain.benchmark.phase_memory import measure_step_memory

    torch.set_num_threads(threads)
    measured = measure_step_memory(point_config(path, point, shape), steps=3)
    return measured.peak, measured.phase_peaks


def measure_point(path: str | Path, point: MatrixPoint, shape: list[str], threads: int = 1) -> PointResult:
    config = point_config(path, point, shape)
    estimate = memory_estimate(config, point.world_size, device="cpu")
    mode = config.train.activation_checkpointing
    per_rank = run_distributed(_measure_on_rank, point.world_size, str(path), point, shape, threads, timeout_s=3600)
    rows = []
    for rank, (peak, phases) in enumerate(per_rank):
        stage = estimate.stages[rank * config.parallel.pipeline // point.world_size]  # ranks are pipeline-major
        rows.append((stage.total(mode), peak, stage.peak_phase(mode), max(phases, key=phases.__getitem__)))
    estimated, measured, estimated_phase, measured_phase = max(rows, key=lambda row: abs(row[0] / row[1] - 1))
    return PointResult(str(path), point, estimate.optimizer_kind, estimated, measured, estimated_phase, measured_phase)


def markdown_table(results: list[PointResult]) -> str:
    lines = ["| config | layout | overrides | DeepSpeed optimizer | estimate GiB | measured GiB | estimate / measured "
             "| peak phase (est. / meas.) |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        overrides = ", ".join(item.split(".", 1)[1] for item in result.point.overrides)
        lines.append(f"| {Path(result.config).stem} | {result.point.layout} | {overrides} | {result.optimizer_kind} "
                     f"| {result.estimated / GIB:.3f} | {result.measured / GIB:.3f} | {result.ratio:.3f} "
                     f"| {result.estimated_phase} / {result.measured_phase} |")
    return "\n".join(lines)
