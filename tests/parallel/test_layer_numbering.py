"""Layer numbering (docs/architecture.md): the set {(layer number, LNS factor)} over all ranks equals
the single-process model's, for pipeline 1, 2 and 4, tied and untied embeddings, even and uneven
splits, and with context parallelism; and under ``lns_gain_init`` every rank's pre-sublayer gains start at
1/sqrt(global layer number).

One 4-rank spawn builds every pipeline layout (the stages only; no engine) and reports each rank's
(layer number, factor) pairs. Beyond the set, each pipeline replica (one data, context and tensor coordinate)
must hold every layer exactly once, and explicit boundaries must put the layers where they say.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lnstrain.model import NormScheme, Transformer, TransformerBlock
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.testing.distributed import run_distributed
from tests.parallel.layouts import Layout, layer_factors, make_config

NUM_LAYERS = 8
PIPELINE_LAYOUTS = [
    Layout("pp2_untied_parameters_dp2", pipeline=2),
    Layout("pp2_tied_uniform_tp2", pipeline=2, tensor=2, tied=True, partition="uniform"),
    Layout("pp4_untied_by_type", pipeline=4, partition="type:TransformerBlock"),
    Layout("pp4_tied_even", pipeline=4, tied=True, boundaries=(2, 2, 2, 2)),
    Layout("pp4_tied_uneven", pipeline=4, tied=True, boundaries=(1, 3, 3, 1)),
    Layout("pp4_untied_uneven", pipeline=4, boundaries=(3, 1, 1, 3)),
    Layout("pp2_context2", pipeline=2, context=2),
]


def numbering_worker(rank: int, world_size: int, layouts: list[Layout]) -> dict[str, tuple]:
    from lnstrain.model.build import build_model

    results = {}
    for layout in layouts:
        config = make_config(layout, num_layers=NUM_LAYERS)
        groups = ParallelGroups.build(layout.tensor, layout.pipeline, context=layout.context)
        module = build_model(config, groups)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (groups.pp_rank, (groups.dp_rank, groups.cp_rank, groups.tp_rank),
                                          layer_factors(module)))
        results[layout.name] = gathered
        gain_config = make_config(layout, num_layers=NUM_LAYERS)
        gain_config.model.norm_scheme = NormScheme.LNS_GAIN_INIT
        module = build_model(gain_config, groups)
        gains = [(b.layer_number, b.lns_factor, b.attention_norm.weight.tolist(), b.mlp_norm.weight.tolist())
                 for b in module.modules() if isinstance(b, TransformerBlock)]
        gathered = [None] * world_size
        dist.all_gather_object(gathered, gains)
        results[f"{layout.name}/lns_gain_init"] = gathered
    return results


@pytest.fixture(scope="module")
def numbering() -> dict[str, list]:
    return run_distributed(numbering_worker, 4, PIPELINE_LAYOUTS, timeout_s=300)[0]


def reference_factors(tied: bool) -> set[tuple[int, float]]:
    config = make_config(Layout("reference", tied=tied), num_layers=NUM_LAYERS)
    return set(layer_factors(Transformer(config.model, ParallelGroups.single_process())))


def test_reference_factors_are_one_over_sqrt_layer_number():
    assert reference_factors(False) == {(ell, 1 / math.sqrt(ell)) for ell in range(1, NUM_LAYERS + 1)}
    assert reference_factors(True) == reference_factors(False)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", PIPELINE_LAYOUTS, ids=lambda layout: layout.name)
def test_pipeline_layer_factors_equal_reference(numbering, layout):
    ranks = numbering[layout.name]
    assert {pair for *_, pairs in ranks for pair in pairs} == reference_factors(layout.tied)
    replicas: dict[tuple[int, int, int], list[int]] = {}
    for _, replica, pairs in ranks:
        replicas.setdefault(replica, []).extend(number for number, _ in pairs)
    for numbers in replicas.values():  # each pipeline replica holds every layer exactly once
        assert sorted(numbers) == list(range(1, NUM_LAYERS + 1))
    if layout.boundaries:
        per_stage = {pp_rank: sorted(n for n, _ in pairs) for pp_rank, _, pairs in ranks}
        first = 1
        for stage, count in enumerate(layout.boundaries):
            assert per_stage[stage] == list(range(first, first + count)), per_stage
            first += count


@pytest.mark.multirank
@pytest.mark.parametrize("layout", PIPELINE_LAYOUTS, ids=lambda layout: layout.name)
def test_lns_gain_init_gains_follow_the_global_layer_number(numbering, layout):
    seen = {}
    for layers in numbering[f"{layout.name}/lns_gain_init"]:
        for number, factor, attention_gain, mlp_gain in layers:
            assert factor == 1.0  # no factor applied, only the initial gains
            assert set(attention_gain) == set(mlp_gain) == {float(torch.tensor(1 / math.sqrt(number)))}
            seen[number] = True
    assert sorted(seen) == list(range(1, NUM_LAYERS + 1))
