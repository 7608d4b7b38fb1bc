"""Precision × ZeRO stage: the DeepSpeed JSON we derive is one DeepSpeed accepts, and the optimizer
kernel is chosen where the parameters will live.

One spawned rank builds real engines for bf16 × ZeRO 0/1/2 on a tiny model and trains a few steps
against an fp32 reference. fp16 is not covered: DeepSpeed's CPU accelerator refuses it ("Type fp16
is not supported on your device").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lnstrain.config.deepspeed_json import accumulates_fp32_gradients_in_backward, deepspeed_config
from lnstrain.config.feasibility import bf16_accumulation_problem, fp16_loss_scaling_problem, layout_problems
from lnstrain.testing.distributed import run_distributed
from lnstrain.training.optimizer import adam_kernel
from tests.parallel.layouts import GLOBAL_BATCH, Layout, global_batch, make_config, rank_micro_batches

STEPS = 3


def _config(dtype: str = "bf16", zero_stage: int = 0, micro_batch: int | None = None, fp32_grad_accum: bool = True,
            pipeline: int = 1):
    config = make_config(Layout("precision", zero_stage=zero_stage, dtype=dtype, pipeline=pipeline), steps=STEPS)
    train = config.train if micro_batch is None else dataclasses.replace(config.train, micro_batch_size=micro_batch)
    return dataclasses.replace(config, train=train,
                               precision=dataclasses.replace(config.precision, fp32_grad_accum=fp32_grad_accum))


@pytest.mark.parametrize("zero_stage,accumulates_in_fp32_key", [(0, False), (1, True), (2, True), (3, True)])
def test_bf16_json_asks_for_fp32_accumulation_only_where_deepspeed_has_it(zero_stage, accumulates_in_fp32_key):
    ds = deepspeed_config(_config(zero_stage=zero_stage), world_size=1)
    immediate = {"immediate_grad_update": True} if zero_stage == 1 else {}  # BF16_Optimizer
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True, **immediate}
    assert ("data_types" in ds) == accumulates_in_fp32_key


def test_bf16_optimizer_accumulates_in_backward_except_under_a_pipeline():
    assert accumulates_fp32_gradients_in_backward(_config(zero_stage=1))
    assert not accumulates_fp32_gradients_in_backward(_config(zero_stage=1, fp32_grad_accum=False))  # ZeRO's own
    assert not accumulates_fp32_gradients_in_backward(_config(zero_stage=1, pipeline=2))
    assert not accumulates_fp32_gradients_in_backward(_config(zero_stage=0, pipeline=2))
    assert "immediate_grad_update" not in deepspeed_config(_config(zero_stage=0, pipeline=2), world_size=2)["bf16"]
    opted_out = dataclasses.replace(_config(zero_stage=1), deepspeed={"bf16": {"immediate_grad_update": False}})
    assert deepspeed_config(opted_out, world_size=1)["bf16"]["immediate_grad_update"] is False


def test_bf16_zero0_with_accumulated_micro_batches_is_refused_naming_the_keys():
    config = _config(zero_stage=0)  # 8 samples in micro-batches of 2: 4 accumulated per step
    (problem,) = [p for p in layout_problems(config, 1) if "fp32_grad_accum" in p]
    assert "accumulates 4 micro-batches" in problem
    for key in ("parallel.zero_stage: 1", "precision.fp32_grad_accum: false", "train.micro_batch_size"):
        assert key in problem
    assert bf16_accumulation_problem(_config(zero_stage=0, micro_batch=GLOBAL_BATCH), 1) == ""
    assert bf16_accumulation_problem(_config(zero_stage=0, fp32_grad_accum=False), 1) == ""
    assert bf16_accumulation_problem(_config(zero_stage=1), 1) == ""
    assert bf16_accumulation_problem(_config(zero_stage=0, pipeline=2), 2) == ""  # BF16_Optimizer: fp32 buffers


def test_adam_kernel_is_fused_when_every_parameter_is_on_one_fused_device_type():
    cuda = torch.device("cuda", 0)  # a device object only: no GPU needed to decide
    assert adam_kernel([cuda, torch.device("cuda", 0)]) == {"fused": True}
    assert adam_kernel(["cuda:1"]) == {"fused": True}
    assert adam_kernel([cuda, torch.device("cpu")]) == {"foreach": True}
    assert adam_kernel([torch.device("cpu")]) == {"fused": True}
    assert adam_kernel([torch.device("meta")]) == {"foreach": True}


class _OptimizerBuilt(Exception):
    pass


def _devices_seen_by_build_optimizer(world_size: int) -> set[str]:
    """build_engine with the accelerator faked to the meta device: where are the parameters when
    the optimizer is built?"""
    from lnstrain.parallel.groups import ParallelGroups
    from lnstrain.training import engine as engine_module

    seen: set[str] = set()

    def spy(module: torch.nn.Module, optim_cfg) -> None:
        seen.update(p.device.type for p in module.parameters())
        raise _OptimizerBuilt

    real_device, real_build = engine_module.training_device, engine_module.build_optimizer
    engine_module.training_device, engine_module.build_optimizer = (lambda: torch.device("meta")), spy
    try:
        engine_module.build_engine(_config(dtype="fp32"), ParallelGroups.build(1, 1, False))
    except _OptimizerBuilt:
        pass
    finally:
        engine_module.training_device, engine_module.build_optimizer = real_device, real_build
    return seen


def _train(config, batches_for_step) -> dict:
    from lnstrain.parallel.groups import ParallelGroups
    from lnstrain.training.engine import build_engine

    engine = build_engine(config, ParallelGroups.build(1, 1, False))
    losses = [engine.train_step(batches_for_step(step)).loss for step in range(STEPS)]
    deepspeed_engine = engine._deepspeed  # which wrapper and data types DeepSpeed chose: its own state
    return {"optimizer": type(deepspeed_engine.optimizer).__name__, "losses": losses,
            "data_types": [str(t) for t in deepspeed_engine.get_data_types()],
            "weights": str(next(engine.module.parameters()).dtype)}


def _precision_worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    results = {"optimizer_devices": _devices_seen_by_build_optimizer(world_size)}

    def micro_batches(step):
        return rank_micro_batches(step, 0, 1)

    def one_batch(step):
        tokens, loss_mask = global_batch(step)
        return [{"tokens": tokens, "loss_mask": loss_mask}]

    runs = {"fp32": (_config(dtype="fp32"), micro_batches),
            "bf16_zero0": (_config(zero_stage=0, micro_batch=GLOBAL_BATCH), one_batch),
            "bf16_zero0_bf16_accum": (_config(zero_stage=0, fp32_grad_accum=False), micro_batches),
            "bf16_zero1": (_config(zero_stage=1), micro_batches),
            "bf16_zero2": (_config(zero_stage=2), micro_batches)}
    for name, (config, batches) in runs.items():
        results[name] = _train(config, batches)
    return results


@pytest.mark.multirank
def test_bf16_engines_build_and_train_under_zero_0_1_2():
    (results,) = run_distributed(_precision_worker, 1, timeout_s=600)
    assert results["optimizer_devices"] == {"meta"}  # moved to the training device before the optimizer

    reference = results["fp32"]["losses"]
    expected_optimizers = {"bf16_zero0": "FP16_UnfusedOptimizer", "bf16_zero0_bf16_accum": "FP16_UnfusedOptimizer",
                           "bf16_zero1": "BF16_Optimizer", "bf16_zero2": "DeepSpeedZeroOptimizer"}
    for name, optimizer in expected_optimizers.items():
        run = results[name]
        assert run["optimizer"] == optimizer, name
        assert run["weights"] == "torch.bfloat16", name
        # bf16 weights and activations: a different numeric path, so close to fp32, not equal
        assert run["losses"] == pytest.approx(reference, abs=3e-2), name
    assert results["bf16_zero1"]["data_types"] == ["torch.bfloat16", "torch.float32"]
    assert results["bf16_zero2"]["data_types"] == ["torch.bfloat16", "torch.float32"]
    assert results["bf16_zero0"]["data_types"] == ["torch.bfloat16", "torch.bfloat16"]


def _torch_add_into_fp32(pairs):
    """What the Triton kernel computes, with torch's add (the CPU has no Triton): one "launch" per call."""
    for target, source in pairs:
        target.add_(source)


def _accumulation_worker(rank: int, world_size: int) -> dict:
    """BF16_Optimizer at ZeRO 1, 4 micro-batches per step: fp32 accumulation in backward (the default)
    and after each backward (DeepSpeed's default, asked for in the deepspeed: section), both with
    lnstrain's gradient add; in backward with the gradients collected into buckets of a few parameters
    added by one call each (the kernel's path, with torch's add standing in for the kernel on the CPU); and
    in backward with DeepSpeed's own cast-then-add."""
    from lnstrain.parallel.groups import ParallelGroups
    from lnstrain.training import accumulation_kernel, bf16_accumulation
    from lnstrain.training.engine import build_engine

    torch.set_num_threads(1)
    results = {}
    for name, section, variant in (("in_backward", {}, "fused"),
                                   ("after_backward", {"bf16": {"immediate_grad_update": False}}, "fused"),
                                   ("bucketed", {}, "bucketed"),
                                   ("bucketed_after_backward", {"bf16": {"immediate_grad_update": False}}, "bucketed"),
                                   ("deepspeed_cast_then_add", {}, "deepspeed")):
        config = dataclasses.replace(_config(zero_stage=1), deepspeed=section)
        engine = build_engine(config, ParallelGroups.build(1, 1, False))
        optimizer = engine._deepspeed.optimizer
        fused = bf16_accumulation.is_installed(optimizer)
        saved = accumulation_kernel.usable, accumulation_kernel.add_into_fp32
        if variant == "bucketed":
            accumulation_kernel.usable = lambda target, source: source.dtype == torch.bfloat16
            accumulation_kernel.add_into_fp32 = _torch_add_into_fp32
            engine.fused_accumulation.bucket_elements = 20_000  # a third of the tiny model a bucket
        if variant == "deepspeed":
            engine.fused_accumulation.set_enabled(False)  # a cast into a new fp32 tensor, then the add
        held = []  # bf16 gradients alive once the last backward is done

        def count_bf16_grads():
            held.append(sum(p.grad is not None for p in engine.module.parameters()))

        try:
            steps = [engine.train_step(rank_micro_batches(step, 0, 1), count_bf16_grads) for step in range(STEPS)]
        finally:
            accumulation_kernel.usable, accumulation_kernel.add_into_fp32 = saved
        results[name] = {
            "optimizer": type(engine._deepspeed.optimizer).__name__,
            "losses": [s.loss for s in steps], "grad_norms": [s.grad_norm for s in steps],
            "masters": [p.detach().clone() for group in engine.base_optimizer.param_groups for p in group["params"]],
            "weights": [p.detach().float().clone() for p in engine.module.parameters()],
            "bf16_grads_held": held, "parameters": len(list(engine.module.parameters())), "fused": fused,
            "launches": engine.fused_accumulation.launches, "micro_batches": STEPS * engine.accumulation_steps,
            "still_fused": bf16_accumulation.is_installed(optimizer),
        }
    return results


@pytest.mark.multirank
def test_bf16_accumulation_in_backward_changes_no_number():
    (results,) = run_distributed(_accumulation_worker, 1, timeout_s=600)
    new, old = results["in_backward"], results["after_backward"]
    assert new["optimizer"] == old["optimizer"] == "BF16_Optimizer"
    assert all(run["fused"] for run in results.values())  # lnstrain's gradient add, installed by build_engine
    assert not results["deepspeed_cast_then_add"]["still_fused"]  # and switched off there
    for other in (old, results["bucketed"], results["bucketed_after_backward"], results["deepspeed_cast_then_add"]):
        assert new["losses"] == other["losses"] and new["grad_norms"] == other["grad_norms"]  # bitwise
        for a, b in zip(new["masters"] + new["weights"], other["masters"] + other["weights"], strict=True):
            assert torch.equal(a, b)
    # each bf16 gradient is dropped once added to the fp32 buffer, instead of held to the end of backward
    assert new["bf16_grads_held"] == [0] * STEPS and old["bf16_grads_held"] == [old["parameters"]] * STEPS
    assert results["bucketed"]["bf16_grads_held"] == [0] * STEPS  # the last bucket added before the step
    # the bucketed add: several gradients a launch, a few launches a micro-batch
    bucketed = results["bucketed"]
    assert bucketed["micro_batches"] < bucketed["launches"] < bucketed["micro_batches"] * bucketed["parameters"] // 2
    assert new["launches"] == 0  # on the CPU the add is torch's, one per gradient, not a launch
    assert max(new["grad_norms"]) > 1.0  # optim.grad_clip: clipping (of the flat buffers) happened and matched


def test_fp16_without_zero_is_refused_because_deepspeed_would_not_scale_the_loss():
    fp16 = _config(dtype="fp16", zero_stage=0)
    assert "parallel.zero_stage: 1" in fp16_loss_scaling_problem(fp16)
    assert fp16_loss_scaling_problem(fp16) in layout_problems(fp16, 1)  # refused before any process group
    assert fp16_loss_scaling_problem(_config(dtype="fp16", zero_stage=1)) == ""
    assert fp16_loss_scaling_problem(_config(zero_stage=0)) == ""  # bf16
