"""Every supported layout against the single-process reference, fp32 on CPU/gloo, LNS on.

Three spawns (1, 2 and 4 ranks) train every layout of the matrix for 10 steps on the same global
batches (a loss mask with a different count of counted tokens per sample, AdamW with decay, warmup,
clipping at 1.0 which is active). Compared with the reference: first-step loss (abs 1e-5), every
gradient of step 1 gathered over ranks and tensor shards (relative 1e-5: ||g - g_ref|| / ||g_ref||
per tensor, read before clipping; ZeRO-3 gradients are gathered with DeepSpeed's
``safe_get_full_grad``), gradient norms (relative 1e-5), the 10-step loss curve (abs 1e-4) and a
held-out loss after training (abs 1e-4). bf16 is checked only loosely (it is a different numeric
format).

Sequence parallelism and replicated KV heads (partial gradients summed inside autograd) run with
pipelines, ZeRO-1/2/3 and bf16, with selective recomputation on the pipelined and the plain path,
and at tensor 4 with each KV head shared by 2 ranks (a sub-group of the tensor group).

Context parallelism (each sample's 16 tokens cut into load-balanced chunks, exact attention across
them) runs at context 2 (ring at ZeRO 0 with lnstrain's clipping, all-to-all at ZeRO 1, ring at
ZeRO 3) and at context 4, and context 2 with tensor 2 (sequence parallel, selective recomputation),
with pipeline 2 (full recomputation), and with data 2 (ZeRO 2), under the same tolerances.
"""

from __future__ import annotations

import pytest

from lnstrain.testing.distributed import run_distributed
from tests.parallel.layouts import STEPS, Layout, layouts_worker, merge_ranks

TWO_RANKS = [
    Layout("tp2", tensor=2),
    Layout("tp2_sequence_parallel", tensor=2, sequence_parallel=True),
    Layout("pp2", pipeline=2, zero_stage=1),
    Layout("pp2_tied_uniform", pipeline=2, tied=True, partition="uniform"),
    Layout("dp2_zero1", zero_stage=1),
    Layout("dp2_zero2", zero_stage=2),
    Layout("dp2_zero3", zero_stage=3),
    Layout("pp2_bf16_zero1", pipeline=2, zero_stage=1, dtype="bf16"),
    Layout("tp2_sp_replicated_kv_bf16_zero1", tensor=2, zero_stage=1, sequence_parallel=True, kv_heads=1,
           fused_qkv=False, dtype="bf16"),
    Layout("cp2_ring", context=2),
    Layout("cp2_all_to_all_zero1", context=2, context_method="all_to_all", zero_stage=1),
    Layout("cp2_ring_zero3", context=2, zero_stage=3),
]
FOUR_RANKS = [
    Layout("pp4_uneven_1_2_2_1", pipeline=4, boundaries=(1, 2, 2, 1)),
    Layout("tp2_pp2_by_type_checkpointed", tensor=2, pipeline=2, zero_stage=1, partition="type:TransformerBlock",
           checkpointing="full"),
    Layout("tp2_dp2_zero1", tensor=2, zero_stage=1),
    # Partial gradients summed inside autograd, so they work past ZeRO-0 / fp32 / no pipeline:
    Layout("tp2_sp_pp2_zero1_selective", tensor=2, pipeline=2, zero_stage=1, sequence_parallel=True,
           checkpointing="selective"),
    Layout("tp2_sp_dp2_zero1_selective", tensor=2, zero_stage=1, sequence_parallel=True, checkpointing="selective"),
    Layout("tp2_dp2_zero2_replicated_kv", tensor=2, zero_stage=2, kv_heads=1, fused_qkv=False),
    Layout("tp4_sp_zero1_kv_shared_by_2", tensor=4, zero_stage=1, sequence_parallel=True, fused_qkv=False),
    Layout("tp2_sp_dp2_zero3_replicated_kv", tensor=2, zero_stage=3, sequence_parallel=True, kv_heads=1,
           fused_qkv=False),  # ZeRO-3 gathers the norm gains the block hands on as stand-ins
    Layout("cp4_ring_zero1", context=4, zero_stage=1),
    Layout("cp2_tp2_sp_zero1_selective", context=2, tensor=2, sequence_parallel=True, zero_stage=1,
           checkpointing="selective"),  # the ring recomputed in backward
    Layout("cp2_pp2_zero1_checkpointed", context=2, pipeline=2, zero_stage=1, checkpointing="full"),
    Layout("cp2_dp2_zero2", context=2, zero_stage=2),
]
EXACT = [layout for layout in TWO_RANKS + FOUR_RANKS if layout.dtype == "fp32"]
REFERENCES = list({layout.reference.name: layout.reference for layout in TWO_RANKS + FOUR_RANKS}.values())


def _run(world_size: int, layouts: list[Layout]) -> dict[str, dict]:
    per_rank = run_distributed(layouts_worker, world_size, layouts, STEPS, timeout_s=600)
    return {layout.name: merge_ranks([rank[layout.name] for rank in per_rank]) for layout in layouts}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    results = {}
    for world_size, layouts in ((1, REFERENCES), (2, TWO_RANKS), (4, FOUR_RANKS)):
        results.update(_run(world_size, layouts))
    return results


def _reference(runs: dict[str, dict], layout: Layout) -> dict:
    return runs[layout.reference.name]


pytestmark = [pytest.mark.multirank, pytest.mark.slow]


@pytest.mark.parametrize("layout", EXACT, ids=lambda layout: layout.name)
def test_first_step_loss_and_curve_match_reference(runs, layout):
    run, reference = runs[layout.name], _reference(runs, layout)
    assert abs(run["losses"][0] - reference["losses"][0]) < 1e-5
    differences = [abs(a - b) for a, b in zip(run["losses"], reference["losses"])]
    assert len(run["losses"]) == STEPS and max(differences) < 1e-4, differences
    assert abs(run["eval_loss"] - reference["eval_loss"]) < 1e-4
    assert run["lrs"] == pytest.approx(reference["lrs"], rel=1e-12)
    assert not any(run["skipped"])
    for rank_losses in run["all_losses"]:  # the reported loss is the same on every rank
        assert rank_losses == run["losses"]


@pytest.mark.parametrize("layout", EXACT, ids=lambda layout: layout.name)
def test_gradients_match_reference(runs, layout):
    run, reference = runs[layout.name], _reference(runs, layout)
    assert sorted(run["gradients"]) == sorted(reference["gradients"])
    for name, expected in reference["gradients"].items():
        actual = run["gradients"][name]
        assert actual.shape == expected.shape, name
        relative = (actual - expected).norm() / expected.norm().clamp(min=1e-12)
        assert relative < 1e-5, f"{name}: relative error {relative:.2e}"


@pytest.mark.parametrize("layout", EXACT, ids=lambda layout: layout.name)
def test_gradient_norms_match_reference(runs, layout):
    run, reference = runs[layout.name], _reference(runs, layout)
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
    assert reference["grad_norms"][0] > 1.0  # so clipping at 1.0 was active and is part of the check


@pytest.mark.parametrize("name", ["pp2_bf16_zero1", "tp2_sp_replicated_kv_bf16_zero1"])
def test_bf16_trains_close_to_fp32(runs, name):
    layout = next(layout for layout in TWO_RANKS if layout.name == name)
    run, reference = runs[name], _reference(runs, layout)
    differences = [abs(a - b) for a, b in zip(run["losses"], reference["losses"])]
    assert max(differences) < 0.05, differences
    assert run["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=0.05)
