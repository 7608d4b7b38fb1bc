"""The names DeepSpeed 0.19 gives a checkpoint's files, and whether a set of names fits a layout.

"mp rank" m = pipeline rank * tensor size + tensor rank; d is the data-parallel rank::

    mp_rank_{m:02d}_model_states.pt                       the module (pipeline 1), schedule, counters
    layer_{i:02d}-model_{t:02d}-model_states.pt           pipeline entry i's shard on tensor rank t
    [bf16_]zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt   data rank d's optimizer partition
    zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt      ZeRO-3: data rank d's module states

DeepSpeed finds some of them by pattern when it loads (every ``layer_{i}-model_*`` file, every
optimizer partition of an mp rank), so a file that fits a pattern but not the saved layout makes it
fail (an assertion deep inside ``load_checkpoint``). ``layout_problems`` says so beforehand.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

MODEL_STATES = re.compile(r"mp_rank_(\d+)_model_states\.pt")
LAYER_STATES = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
OPTIMIZER_PARTITION = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
ZERO3_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
RNG_STATES = re.compile(r"rng/rank_(\d{5})\.pt")


def layout_problems(names: Iterable[str], tensor: int, pipeline: int, data: int) -> list[str]:
    """Why files ``names`` (relative to the step directory) cannot be one checkpoint saved at
    (``tensor``, ``pipeline``, ``data``): a file of a rank the layout does not have, or an incomplete
    set of optimizer partitions, layer shards or RNG files. Empty when they fit."""
    model_ranks = tensor * pipeline
    problems = []
    partitions: dict[int, set[int]] = defaultdict(set)
    layer_shards: dict[int, set[int]] = defaultdict(set)
    rng_ranks: set[int] = set()
    for name in sorted(names):
        if match := MODEL_STATES.fullmatch(name):
            if int(match.group(1)) >= model_ranks:
                problems.append(f"{name}: a model-parallel rank the saved layout (tensor {tensor} x pipeline "
                                f"{pipeline}) does not have")
        elif match := LAYER_STATES.fullmatch(name):
            if int(match.group(2)) >= tensor:
                problems.append(f"{name}: a tensor rank the saved layout (tensor {tensor}) does not have")
            layer_shards[int(match.group(1))].add(int(match.group(2)))
        elif match := OPTIMIZER_PARTITION.fullmatch(name) or ZERO3_MODEL_STATES.fullmatch(name):
            data_rank, mp_rank = (int(group) for group in match.groups()[-2:])
            if data_rank >= data or mp_rank >= model_ranks:
                problems.append(f"{name}: a rank the saved layout (tensor {tensor}, pipeline {pipeline}, data "
                                f"{data}) does not have")
            if match.re is OPTIMIZER_PARTITION:
                partitions[mp_rank].add(data_rank)
        elif match := RNG_STATES.fullmatch(name):
            rng_ranks.add(int(match.group(1)))
    for mp_rank, data_ranks in sorted(partitions.items()):
        if data_ranks != set(range(data)):
            problems.append(f"optimizer partitions of mp rank {mp_rank} cover data ranks {sorted(data_ranks)}, but "
                            f"the saved layout has data ranks 0..{data - 1}")
    for index, shards in sorted(layer_shards.items()):
        if shards != set(range(tensor)):
            problems.append(f"pipeline entry {index} has shards of tensor ranks {sorted(shards)}, but the saved "
                            f"layout has tensor ranks 0..{tensor - 1}")
    world_size = model_ranks * data
    if rng_ranks and rng_ranks != set(range(world_size)):
        problems.append(f"RNG files of ranks {sorted(rng_ranks)[:8]}, but the saved layout has ranks "
                        f"0..{world_size - 1}")
    return problems
