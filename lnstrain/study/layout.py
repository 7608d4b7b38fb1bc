"""Choose a parallel layout that fits a run into the GPUs it is given.

Candidates are tried from cheapest to most communication- or compute-hungry, and the first one
whose estimated memory fits ``gpu_memory_gib × memory_margin`` wins:
tensor × context × pipeline from small to large (tensor inside a node, preferred over context, and
context over pipeline, at equal size), then ZeRO stage 1, 2, 3 (3 only without pipeline), then
recomputation none, selective, full, then the largest micro-batch (from the config's value down by
halves) that divides the global batch.
A tensor size that the model cannot use (heads or FFN not divisible, as for 1B's FFN of 5461) is
skipped with the config's own reason, which the plan reports.

Context parallelism is a candidate for long sequences only: sizes that leave every rank at least
``MIN_CONTEXT_TOKENS`` of each sequence (enough attention work per ring step to hide the transfer of
the next block). Where there is one, full recomputation comes last, after every context size without
it: a long sequence is split before its forward is run twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lnstrain.config.run_config import Config
from lnstrain.estimate.memory import CHECKPOINTING_MODES, GIB, MemoryEstimate, memory_estimate
from lnstrain.estimate.validation import split_file_problems
from lnstrain.study.spec import ClusterProfile

MIN_CONTEXT_TOKENS = 4096
"""The fewest tokens of each sequence a context rank is given by the search (``_context_sizes``)."""


@dataclass
class LayoutChoice:
    """The chosen layout (applied to ``config``) and why others were not taken."""

    config: Config
    gpus: int
    memory: MemoryEstimate
    notes: list[str] = field(default_factory=list)


class LayoutError(ValueError):
    """No layout fits; the message lists why."""


def with_layout(config: Config, tensor: int, pipeline: int, zero_stage: int, checkpointing: str,
                micro_batch: int, context: int = 1) -> Config:
    parallel = dataclasses.replace(config.parallel, tensor=tensor, pipeline=pipeline, zero_stage=zero_stage,
                                   sequence_parallel=tensor > 1, pipeline_boundaries=None, context=context)
    train = dataclasses.replace(config.train, activation_checkpointing=checkpointing, micro_batch_size=micro_batch)
    return config.replace(parallel=parallel, train=train)


def _micro_batches(config: Config) -> list[int]:
    sizes, size = [], config.train.micro_batch_size
    while size >= 1:
        sizes.append(size)
        size //= 2
    return sizes


def _powers_of_two_up_to(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _context_sizes(config: Config, gpus: int) -> list[int]:
    """1, and the context sizes that leave every rank at least ``MIN_CONTEXT_TOKENS`` tokens of each sequence."""
    seq_len = config.data.seq_len
    return [c for c in _powers_of_two_up_to(gpus)
            if c == 1 or (seq_len % (2 * c) == 0 and seq_len // c >= MIN_CONTEXT_TOKENS)]


def fits(memory: MemoryEstimate, cluster: ClusterProfile) -> bool:
    return memory.total <= cluster.gpu_memory_gib * cluster.memory_margin * GIB


def check_layout(config: Config, gpus: int, cluster: ClusterProfile) -> LayoutChoice:
    """Keep the config's own layout; raise ``LayoutError`` if it is invalid or does not fit."""
    problems, _ = split_file_problems(config, gpus)
    if problems:
        raise LayoutError("; ".join(problems))
    memory = memory_estimate(config, gpus)
    if not fits(memory, cluster):
        raise LayoutError(f"the config's layout needs {memory.total / GIB:.1f} GiB per GPU, more than "
                          f"{cluster.memory_margin:.0%} of {cluster.gpu_memory_gib} GiB")
    return LayoutChoice(config, gpus, memory)


def choose_layout(config: Config, gpus: int, cluster: ClusterProfile) -> LayoutChoice:
    """The first layout (in the module docstring's order) that is valid and fits; else ``LayoutError``."""
    notes: list[str] = []
    tensor_sizes = []
    for tensor in _powers_of_two_up_to(min(gpus, cluster.gpus_per_node)):
        reasons = config.model.validate(tensor_parallel=tensor)
        if reasons:
            notes.append(f"tensor {tensor} skipped: {'; '.join(reasons)}")
        else:
            tensor_sizes.append(tensor)
    shapes = sorted(((t, c, p) for t in tensor_sizes for c in _context_sizes(config, gpus)
                     for p in _powers_of_two_up_to(min(gpus // t, config.model.num_layers)) if gpus % (t * c * p) == 0),
                    key=lambda tcp: (tcp[0] * tcp[1] * tcp[2], tcp[2], tcp[1]))
    long_sequence = any(c > 1 for _, c, _ in shapes)
    passes = ([mode for mode in CHECKPOINTING_MODES if mode != "full"], ["full"]) if long_sequence else (
        list(CHECKPOINTING_MODES),)
    smallest = None
    for modes in passes:
        for tensor, context, pipeline in shapes:
            for zero_stage in ((1, 2, 3) if pipeline == 1 else (1,)):
                for checkpointing in modes:
                    for micro_batch in _micro_batches(config):
                        candidate = with_layout(config, tensor, pipeline, zero_stage, checkpointing, micro_batch,
                                                context)
                        if split_file_problems(candidate, gpus)[0]:
                            continue
                        memory = memory_estimate(candidate, gpus)
                        if fits(memory, cluster):
                            return LayoutChoice(candidate, gpus, memory, notes)
                        if smallest is None or memory.total < smallest[1]:
                            split = f"tensor {tensor}" + (f" × context {context}" if context > 1 else "")
                            smallest = (f"{split} × pipeline {pipeline}, ZeRO {zero_stage}, recompute "
                                        f"{checkpointing}, micro-batch {micro_batch}", memory.total)
    best = f"; the smallest estimate is {smallest[1] / GIB:.1f} GiB ({smallest[0]})" if smallest else ""
    raise LayoutError(f"no layout of {gpus} GPUs fits {cluster.memory_margin:.0%} of {cluster.gpu_memory_gib} GiB"
                      f"{best}; give the run more GPUs (gpus_per_run) {'; ' + '; '.join(notes) if notes else ''}")
