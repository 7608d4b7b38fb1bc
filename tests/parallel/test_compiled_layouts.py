"""``train.compile`` composes with the layouts it is allowed in: compiled layers train exactly as eager ones.

Two ranks train each layout twice, eager and compiled, for 3 steps on the same global batches. The
compiled runs use the ``aot_eager`` backend: dynamo and AOTAutograd trace forward and backward through
the layout's hooks and collectives as inductor would, without generating kernels (the CPU's kernel
compilation would take minutes here, and generated kernels round differently, which
``tests/gpu/test_model_on_device.py`` compares on a GPU). So the losses must be bitwise equal, and every
compiled layer must be one graph without a break (a break would mean the layout's own code, not lnstrain's
model, is being traced). Context parallelism compiles too: the ring is one opaque operator in the graph
(selective recomputation runs it again in backward), the all-to-all form's exchanges are functional
collectives dynamo traces (with full recomputation here); its compiled losses are also compared with one
process's eager run, within the layout tests' fp32 tolerances (first loss 1e-5, the curve 1e-4).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lnstrain.config.feasibility import ZERO3_COMPILE_REFUSAL, compiles_layers
from lnstrain.config.run_config import Config
from lnstrain.testing.distributed import run_distributed
from tests.parallel.layouts import Layout, rank_micro_batches

STEPS = 3
LAYOUTS = [
    Layout("dp2_zero1_bf16", zero_stage=1, dtype="bf16"),  # the GPU check's training layout, two ranks
    Layout("dp2_zero2_overlap", zero_stage=2),  # overlap_comm: buckets reduced during the backward
    Layout("tp2_sequence_parallel", tensor=2, sequence_parallel=True),
    Layout("pp2_zero1_full_checkpointing", pipeline=2, zero_stage=1, checkpointing="full"),
    Layout("cp2_ring_zero1_selective", context=2, zero_stage=1, checkpointing="selective"),
    Layout("cp2_all_to_all_full_checkpointing", context=2, context_method="all_to_all", checkpointing="full"),
]
CONTEXT = [layout for layout in LAYOUTS if layout.context > 1]


def compiled(config: Config, setting: bool | str = True) -> Config:
    return config.replace(train=dataclasses.replace(config.train, compile=setting, compile_backend="aot_eager"))


def _train_eager_and_compiled(rank: int, world_size: int, layouts: list[Layout]) -> dict:
    from torch._dynamo.utils import counters

    from lnstrain.model.build import build_groups
    from lnstrain.training.engine import build_engine

    torch.set_num_threads(1)
    results = {}
    for layout in layouts:
        for name, config in (("eager", layout.config(STEPS)), ("compiled", compiled(layout.config(STEPS)))):
            torch._dynamo.reset()  # each layout traced afresh, not served from the previous layout's graphs
            counters.clear()
            groups = build_groups(config)
            engine = build_engine(config, groups)
            losses = [engine.train_step(rank_micro_batches(step, groups.dp_rank, groups.dp_size)).loss
                      for step in range(STEPS)]
            results[layout.name, name] = {"losses": losses, "graph_breaks": sum(counters["graph_break"].values()),
                                          "graphs": counters["stats"]["unique_graphs"]}
    return results


def _train_one_process(rank: int, world_size: int, layout: Layout) -> list[float]:
    from lnstrain.model.build import build_groups
    from lnstrain.training.engine import build_engine

    torch.set_num_threads(1)
    config = layout.config(STEPS)
    groups = build_groups(config)
    engine = build_engine(config, groups)
    return [engine.train_step(rank_micro_batches(step, 0, 1)).loss for step in range(STEPS)]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_distributed(_train_eager_and_compiled, 2, LAYOUTS, timeout_s=600)


@pytest.fixture(scope="module")
def one_process() -> list[float]:
    return run_distributed(_train_one_process, 1, CONTEXT[0].reference, timeout_s=300)[0]


pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_compiled_layers_train_exactly_as_eager_layers(runs, layout):
    for rank in runs:
        eager, compiled_run = rank[layout.name, "eager"], rank[layout.name, "compiled"]
        assert compiled_run["losses"] == eager["losses"]
        assert eager["graphs"] == 0 and compiled_run["graphs"] >= 1  # the compiled run did compile
        assert compiled_run["graph_breaks"] == 0


@pytest.mark.parametrize("layout", CONTEXT, ids=lambda layout: layout.name)
def test_compiled_context_parallel_layers_train_as_one_process(runs, one_process, layout):
    losses = runs[0][layout.name, "compiled"]["losses"]
    assert abs(losses[0] - one_process[0]) < 1e-5
    assert max(abs(a - b) for a, b in zip(losses, one_process)) < 1e-4, (losses, one_process)


def test_auto_compiles_on_cuda_only_and_zero3_is_refused_with_a_reason():
    config = LAYOUTS[0].config(STEPS)
    auto = compiled(config, "auto")
    assert compiles_layers(auto, "cuda") and not compiles_layers(auto, "cpu")
    assert compiles_layers(compiled(config, True), "cpu") and not compiles_layers(compiled(config, False), "cuda")
    zero3 = config.replace(parallel=dataclasses.replace(config.parallel, zero_stage=3))
    assert not compiles_layers(compiled(zero3, "auto"), "cuda")  # auto leaves ZeRO-3 eager
    problems = compiled(zero3, True).validate(world_size=2)
    assert ZERO3_COMPILE_REFUSAL in problems and "zero_stage 1 or 2" in ZERO3_COMPILE_REFUSAL
    context = CONTEXT[0].config(STEPS)  # context parallelism compiles like any other layout
    assert compiles_layers(compiled(context, "auto"), "cuda") and not compiles_layers(compiled(context, "auto"), "cpu")
    assert not [problem for problem in compiled(context, True).validate(world_size=2) if "compile" in problem]
