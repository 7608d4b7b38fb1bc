"""FP8 (``precision.fp8``) in training: a tiny bf16 model trains with float8 linears close to bf16, and
float8 composes with tensor, sequence and pipeline parallelism and ZeRO 1-3, each layout against the
single-process FP8 run.

The runs are the layout tests' (``tests/parallel/layouts.py``): the 6-layer tiny LNS model, AdamW with
decay, warmup and clipping, DeepSpeed engines on gloo. Tolerances:

- Learning, one rank, bf16: 8 steps on one repeated global batch (so that the loss falls, from 4.6 by
  more than 0.5), FP8 against bf16: every loss within 0.05, a fifteenth of the fall (measured: 0.002).
- Parity, fp32 engines switched to float8 in place (``set_fp8_mode``; products in float8, everything
  else fp32): every gradient of step 1, gathered over ranks and shards, within 1e-5 of the single-process
  float8 run's (relative Frobenius error per tensor; measured: at most 5e-7), where the fp32 run without
  float8 differs from it by more than 1e-2 in most tensors (measured: 3-16 %); loss curves within 1e-5. The float8 operands are the same in every
  layout because the scales are the whole tensors' (``tests/parallel/test_float8.py`` checks the scales
  themselves).
- The configured path, bf16 with ``precision.fp8``: loss curves within 1e-2 of the single-process bf16
  float8 run (measured: at most 9e-4). Not closer, and not gradient by gradient, because float8 amplifies bf16's differences
  between layouts: an input a bf16 step off rounds to the neighbouring float8 value about once in 32
  elements (e4m3 keeps 3 mantissa bits to bf16's 7), so layouts' step-1 gradients differ by 3-12 %, as
  much as float8 differs from bf16.
"""

from __future__ import annotations

import pytest

from lnstrain.testing.distributed import run_distributed
from tests.parallel import layouts
from tests.parallel.layouts import Layout, layouts_worker, merge_ranks

STEPS, LEARNING_STEPS = 4, 8
LEARNING = [Layout("bf16", zero_stage=1, dtype="bf16"),
            Layout("bf16_fp8_tensorwise", zero_stage=1, dtype="bf16", fp8="tensorwise"),
            Layout("bf16_fp8_rowwise", zero_stage=1, dtype="bf16", fp8="rowwise")]
REFERENCES = [Layout("fp32"), Layout("fp32_fp8_tensorwise", fp8_in_place="tensorwise"),
              Layout("fp32_fp8_rowwise", fp8_in_place="rowwise"), *LEARNING[1:]]
TWO_RANKS = [  # (layout, its single-process reference)
    (Layout("tp2_sp_rowwise", tensor=2, sequence_parallel=True, fp8_in_place="rowwise"), "fp32_fp8_rowwise"),
    (Layout("tp2_tensorwise", tensor=2, fp8_in_place="tensorwise"), "fp32_fp8_tensorwise"),
    (Layout("pp2_zero1_tensorwise", pipeline=2, zero_stage=1, fp8_in_place="tensorwise"), "fp32_fp8_tensorwise"),
    (Layout("dp2_zero1_tensorwise", zero_stage=1, fp8_in_place="tensorwise"), "fp32_fp8_tensorwise"),
    (Layout("dp2_zero2_tensorwise", zero_stage=2, fp8_in_place="tensorwise"), "fp32_fp8_tensorwise"),
    (Layout("dp2_zero3_tensorwise", zero_stage=3, fp8_in_place="tensorwise"), "fp32_fp8_tensorwise"),
]
CONFIGURED = [  # bf16 with precision.fp8
    (Layout("bf16_tp2_sp_rowwise", tensor=2, zero_stage=1, sequence_parallel=True, dtype="bf16", fp8="rowwise"),
     "bf16_fp8_rowwise"),
    (Layout("bf16_pp2_tensorwise", pipeline=2, zero_stage=1, dtype="bf16", fp8="tensorwise"), "bf16_fp8_tensorwise"),
    (Layout("bf16_dp2_zero3_tensorwise", zero_stage=3, dtype="bf16", fp8="tensorwise"), "bf16_fp8_tensorwise"),
]

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def repeated_batch_worker(rank: int, world_size: int, layouts_to_run: list[Layout], steps: int) -> dict:
    """``layouts_worker`` with every step's global batch the first one (in a rank process of its own)."""
    first = layouts.global_batch
    layouts.global_batch = lambda step: first(0)
    return layouts_worker(rank, world_size, layouts_to_run, steps)


def _run(world_size: int, layouts_to_run: list[Layout], worker=layouts_worker, steps: int = STEPS) -> dict[str, dict]:
    per_rank = run_distributed(worker, world_size, layouts_to_run, steps, timeout_s=600)
    return {layout.name: merge_ranks([rank[layout.name] for rank in per_rank]) for layout in layouts_to_run}


@pytest.fixture(scope="module")
def learning() -> dict[str, dict]:
    return _run(1, LEARNING, repeated_batch_worker, LEARNING_STEPS)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {**_run(1, REFERENCES), **_run(2, [layout for layout, _ in TWO_RANKS + CONFIGURED])}


def relative_errors(gradients: dict, reference: dict) -> dict[str, float]:
    assert sorted(gradients) == sorted(reference)
    return {name: float((gradients[name] - expected).norm() / expected.norm().clamp(min=1e-12))
            for name, expected in reference.items()}


def loss_differences(run: dict, reference: dict) -> list[float]:
    assert len(run["losses"]) == len(reference["losses"]) and not any(run["skipped"])
    for rank_losses in run["all_losses"]:  # the same on every rank
        assert rank_losses == run["losses"]
    return [abs(a - b) for a, b in zip(run["losses"], reference["losses"])]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_tiny_bf16_model_trains_with_fp8_close_to_bf16(learning, recipe):
    fp8, bf16 = learning[f"bf16_fp8_{recipe}"], learning["bf16"]
    differences = loss_differences(fp8, bf16)
    assert len(differences) == LEARNING_STEPS and 0 < max(differences) < 0.05, differences
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.5 and bf16["losses"][-1] < bf16["losses"][0] - 0.5


@pytest.mark.parametrize("layout,reference", TWO_RANKS, ids=[layout.name for layout, _ in TWO_RANKS])
def test_each_layout_computes_the_single_process_float8_products(runs, layout, reference):
    run, expected = runs[layout.name], runs[reference]
    errors = relative_errors(run["gradients"], expected["gradients"])
    assert max(errors.values()) < 1e-5, errors
    without = relative_errors(runs["fp32"]["gradients"], expected["gradients"])
    assert sorted(without.values())[len(without) // 2] > 1e-2, without  # the median: float8 shows
    assert max(loss_differences(run, expected)) < 1e-5


@pytest.mark.parametrize("layout,reference", CONFIGURED, ids=[layout.name for layout, _ in CONFIGURED])
def test_bf16_layouts_with_fp8_train_as_the_single_process_run(runs, layout, reference):
    assert max(loss_differences(runs[layout.name], runs[reference])) < 1e-2
