"""bf16 training steps on the device match the CPU fp32 reference, for Pre-LN and LNS.

Both sides are ``build_engine(...).train_step`` on the layout tests' model and batches (6 layers,
grouped-query attention, 4 micro-batches of masked tokens per step, AdamW with decay, clipping, warmup),
ZeRO 1: the device runs DeepSpeed's BF16_Optimizer (bf16 weights, fp32 master weights and gradient
accumulation), the reference runs fp32 in a CPU rank (``DS_ACCELERATOR=cpu``). The engine must have
put the model on the device in bf16 and handed DeepSpeed the fused AdamW.

Tolerances (bf16 against fp32; measured with the CPU as the device: losses 8e-4, gradient norm 0.06%,
gradients 1.8e-2): the losses of 5 steps within 5e-3 (0.1% of a loss of 4.6), the first step's gradient
norm within 1%, and each parameter's first-step gradient within 5e-2 relative L2 error (bf16 rounds
every activation and gradient to 8 significant bits). Between Pre-LN and LNS the gradients of the
norm gains differ by order 1 (LNS scales them by 1/sqrt(l)), which the per-parameter check sees.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.gpu.helpers import relative_error, run_on

pytestmark = pytest.mark.gpu

SCHEMES = ("pre_ln", "lns")
STEPS = 5
LOSS_TOLERANCE = 5e-3
GRAD_NORM_TOLERANCE = 1e-2
GRADIENT_TOLERANCE = 5e-2


def innermost_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def train_schemes(rank: int, world_size: int, dtype: str, steps: int) -> dict[str, dict]:
    """Rank function: an engine per norm scheme, ``steps`` steps each; CPU tensors out."""
    from lnstrain.benchmark.runners import with_norm_scheme
    from lnstrain.parallel.groups import ParallelGroups
    from lnstrain.training.engine import build_engine
    from tests.parallel.layouts import Layout, full_gradients, make_config, rank_micro_batches

    results = {}
    for scheme in SCHEMES:
        config = with_norm_scheme(make_config(Layout(scheme, zero_stage=1, dtype=dtype), steps=steps), scheme)
        config = config.replace(train=dataclasses.replace(config.train, compile=False))  # eager: auto compiles on CUDA
        groups = ParallelGroups.build(1, 1)
        engine = build_engine(config, groups)
        gradients: dict[str, torch.Tensor] = {}

        def capture() -> None:
            gradients.update({name: grad.cpu() for name, grad in
                              full_gradients(engine.module, groups, config.model.vocab_size).items()})

        steps_taken = [engine.train_step(rank_micro_batches(step, 0, 1), before_optimizer_step=capture if step == 0 else None)
                       for step in range(steps)]
        weight = next(engine.module.parameters())
        results[scheme] = {
            "losses": [s.loss for s in steps_taken], "grad_norms": [s.grad_norm for s in steps_taken],
            "gradients": gradients, "weights": (weight.device.type, str(weight.dtype)),
            "fused": [group.get("fused") for group in innermost_optimizer(engine._deepspeed.optimizer).param_groups]}
    return results


@pytest.fixture(scope="module")
def runs(device) -> dict[str, dict]:
    return {"device": run_on(device.type, train_schemes, "bf16", STEPS),
            "reference": run_on("cpu", train_schemes, "fp32", STEPS)}


@pytest.mark.gpu_core
@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_steps_on_the_device_match_the_fp32_cpu_reference(runs, device, scheme):
    ours, reference = runs["device"][scheme], runs["reference"][scheme]
    assert ours["weights"] == (device.type, "torch.bfloat16") and reference["weights"] == ("cpu", "torch.float32")
    assert ours["fused"] and all(ours["fused"]), ours["fused"]  # the fused AdamW kernel under DeepSpeed
    assert ours["losses"] == pytest.approx(reference["losses"], abs=LOSS_TOLERANCE)
    assert ours["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=GRAD_NORM_TOLERANCE)
    assert sorted(ours["gradients"]) == sorted(reference["gradients"]) and ours["gradients"]
    for name, gradient in reference["gradients"].items():
        assert relative_error(ours["gradients"][name], gradient) <= GRADIENT_TOLERANCE, name
