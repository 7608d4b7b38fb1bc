"""The DeepSpeed JSON, derived from the run config (never written by hand).

lnstrain builds the optimizer and the learning-rate schedule itself and hands them to DeepSpeed, so
the JSON holds only batch shape, precision, ZeRO and clipping, as ``lnstrain.config.feasibility``
decides them (which optimizer DeepSpeed will wrap ours in, who clips). The config's ``deepspeed:``
section is merged in, for DeepSpeed options lnstrain does not model (bucket sizes, offload, ...).
"""

from __future__ import annotations

from typing import Any

from lnstrain.config.feasibility import OptimizerKind, asks_fp32_accumulation, optimizer_kind
from lnstrain.config.loader import deep_merge
from lnstrain.config.run_config import Config
from lnstrain.deepspeed_adapter import deepspeed_json_refusal
from lnstrain.estimate.parameters import largest_stage_parameters

# DeepSpeed prints its own progress every N steps; lnstrain logs itself, so this is effectively never.
_QUIET_STEPS = 2**31 - 1

DEEPSPEED_BUCKET_DEFAULT = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` and ``allgather_bucket_size`` (elements)."""
_BUCKET_ROUNDING = 2**20


def zero_bucket_elements(config: Config) -> int:
    """The ZeRO bucket sizes lnstrain asks for: DeepSpeed's default, or the parameters one rank holds
    when fewer (rounded up to a multiple of 2**20).

    DeepSpeed allocates its ZeRO reduce bucket at full size whatever the model (stages 1 and 2 in every
    backward, stage 3 for the whole run): 500M elements, 1.9 GiB in fp32, for a 134M-parameter model.
    A bucket that holds every gradient of the rank reduces them all at once either way, so capping it
    there changes no reduction and no number, only the memory.
    """
    held = largest_stage_parameters(config.model, config.parallel.tensor, config.parallel.pipeline,
                                    config.parallel.pipeline_boundaries)
    rounded = -(-held // _BUCKET_ROUNDING) * _BUCKET_ROUNDING
    return min(DEEPSPEED_BUCKET_DEFAULT, rounded)


def overlaps_gradient_reduction(config: Config, world_size: int) -> bool:
    """Whether ZeRO 1/2 reduces gradients during the backward (``overlap_comm``): where there is a
    reduction to hide (several data × context ranks) and DeepSpeed's ZeRO optimizer does it. With one
    such rank there is nothing to overlap and the second bucket would only cost memory;
    BF16_Optimizer (bf16 at ZeRO 1 with fp32 accumulation) reduces after the last micro-batch whatever
    the option says. The order of the additions is the same either way: the numbers do not change."""
    return (optimizer_kind(config) is OptimizerKind.ZERO and config.parallel.zero_stage in (1, 2)
            and config.shard_replicas(world_size) > 1)


def accumulates_fp32_gradients_in_backward(config: Config) -> bool:
    """Whether BF16_Optimizer adds each bf16 gradient into its fp32 buffer as soon as backward produces
    it, and drops the bf16 one (``bf16.immediate_grad_update``), rather than after each backward.

    After each backward DeepSpeed would otherwise add every gradient into its fp32 buffer from the
    bf16 ``.grad``, which it keeps and zeroes before the next micro-batch, so that autograd then adds
    each new gradient to zeros: a bf16 zero and a bf16 add per parameter and micro-batch that change
    nothing, and every bf16 gradient held to the end of backward. Both ways add the same bf16
    gradients to the same fp32 buffer in the same micro-batch order: the numbers are the same.
    Not under a pipeline, whose engine reduces tied weights' gradients from the bf16 ``.grad``.
    """
    return optimizer_kind(config) is OptimizerKind.BF16_OPTIMIZER and config.parallel.pipeline == 1


def deepspeed_config(config: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON for ``config`` on ``world_size`` ranks."""
    precision = config.precision
    derived: dict[str, Any] = {
        # DeepSpeed's data-parallel ranks are data × context, each with its micro-batches' chunks
        "train_batch_size": config.train.global_batch_size * config.parallel.context,
        "train_micro_batch_size_per_gpu": config.train.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accumulation_steps(world_size),
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": {"stage": config.parallel.zero_stage},
        # bf16: skipping a step whose gradients are not finite is DeepSpeed's default; lnstrain's
        # non-finite policies rely on it, so it is stated rather than inherited
        "bf16": {"enabled": True, "check_grad_overflow": True} if precision.dtype == "bf16" else {"enabled": False},
        "fp16": {
            "enabled": precision.dtype == "fp16",
            "loss_scale": 0,  # 0 selects dynamic loss scaling
            "initial_scale_power": precision.initial_loss_scale_power,
            "loss_scale_window": precision.loss_scale_window,
            "hysteresis": precision.hysteresis,
            "min_loss_scale": precision.min_loss_scale,
        },
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
    }
    if config.parallel.zero_stage > 0:
        bucket = zero_bucket_elements(config)
        derived["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        if overlaps_gradient_reduction(config, world_size):
            derived["zero_optimization"]["overlap_comm"] = True
    if asks_fp32_accumulation(config):  # BF16_Optimizer at ZeRO 1, the ZeRO optimizers at 2 and 3
        derived["data_types"] = {"grad_accum_dtype": "fp32"}
    if accumulates_fp32_gradients_in_backward(config):
        derived["bf16"]["immediate_grad_update"] = True
    if config.parallel.pipeline > 1:
        derived["pipeline"] = {"activation_checkpoint_interval": 0}
    merged = deep_merge(derived, config.deepspeed)
    if optimizer_kind(config).lnstrain_clips:  # lnstrain clips (GradClipHook): DeepSpeed must not clip again
        merged["gradient_clipping"] = 0.0
    return merged


def deepspeed_config_problems(config: Config, world_size: int) -> list[str]:
    """What DeepSpeed's own config parser refuses in the JSON for ``config`` (the ``deepspeed:``
    section merged in): a misspelt or mistyped ZeRO option, fp16 and bf16 both enabled, batch keys that
    disagree. Needs a config whose layout is valid. Imports DeepSpeed (about a second), no process group."""
    from lnstrain.parallel.deepspeed_comm import name_cpu_accelerator_if_no_cuda

    name_cpu_accelerator_if_no_cuda()  # before DeepSpeed's first import, which would warn otherwise
    derived = deepspeed_config(config, world_size)
    batch = [derived.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps")]
    dp = config.shard_replicas(world_size)
    if not all(isinstance(n, int) for n in batch) or batch[0] != batch[1] * batch[2] * dp:
        return [f"deepspeed: train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                f"({batch[0]}, {batch[1]}, {batch[2]}) do not match DeepSpeed's {dp} data-parallel rank(s) (data × context); lnstrain derives "
                "them from train.global_batch_size and train.micro_batch_size: remove them from the deepspeed: "
                "section"]
    # without process groups DeepSpeed counts one data-parallel rank; the batch was checked above
    refusal = deepspeed_json_refusal({**derived, "train_batch_size": batch[1] * batch[2]})
    if refusal is not None:
        return [f"deepspeed: DeepSpeed refuses the DeepSpeed JSON lnstrain derives from this config "
                f"(with the deepspeed: section merged in): {refusal}"]
    return []

