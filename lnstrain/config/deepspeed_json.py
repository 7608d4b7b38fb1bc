"""The DeepSpeed JSON, derived from the run config (never written by hand).

lnstrain builds the optimizer and the learning-rate schedule itself and hands them to DeepSpeed, so
the JSON holds only batch shape, precision, ZeRO and clipping. The config's ``deepspeed:`` section
is merged last, for DeepSpeed options lnstrain does not model (bucket sizes, offload, ...).
"""

from __future__ import annotations

from typing import Any

from lnstrain.config.loader import deep_merge
from lnstrain.config.run_config import Config

# DeepSpeed prints its own progress every N steps; lnstrain logs itself, so this is effectively never.
_QUIET_STEPS = 2**31 - 1


def deepspeed_config(config: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON for ``config`` on ``world_size`` ranks."""
    precision = config.precision
    derived: dict[str, Any] = {
        "train_batch_size": config.train.global_batch_size,
        "train_micro_batch_size_per_gpu": config.train.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accumulation_steps(world_size),
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": {"stage": config.parallel.zero_stage},
        "bf16": {"enabled": precision.dtype == "bf16"},
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
    if precision.dtype == "bf16" and precision.fp32_grad_accum:
        derived["data_types"] = {"grad_accum_dtype": "fp32"}
    if config.parallel.pipeline > 1:
        derived["pipeline"] = {"activation_checkpoint_interval": 0}
    return deep_merge(derived, config.deepspeed)
