"""Tokens per second, achieved TFLOP/s and MFU from a step time.

FLOPs per token come from ``lnstrain.estimate.flops`` (6·N + 12·L·h·s, attention counted
non-causal as Megatron-LM, torchtitan and OLMo report it; the causal count 6·N + 6·L·h·s is given
beside it). MFU = achieved model TFLOP/s per device / the device's peak; recomputation from
activation checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lnstrain.estimate.flops import FlopsPerToken


@dataclass(frozen=True)
class Throughput:
    """Rates for one runner. ``mfu`` is None without a known peak."""

    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    tflops_per_device_causal: float
    mfu: float | None
    mfu_causal: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def throughput(step_seconds: float, tokens_per_step: int, flops: FlopsPerToken, num_devices: int,
               peak_tflops: float | None) -> Throughput:
    """Rates for a step of ``tokens_per_step`` tokens (global) taking ``step_seconds`` on ``num_devices``."""
    if step_seconds <= 0 or num_devices < 1 or tokens_per_step < 1:
        raise ValueError(f"need step_seconds > 0, num_devices >= 1 and tokens_per_step >= 1 "
                         f"(got {step_seconds}, {num_devices}, {tokens_per_step})")
    tokens_per_s = tokens_per_step / step_seconds
    per_device = tokens_per_s / num_devices
    tflops = flops.noncausal * per_device / 1e12
    tflops_causal = flops.causal * per_device / 1e12
    return Throughput(tokens_per_s=tokens_per_s, tokens_per_s_per_device=per_device, tflops_per_device=tflops,
                      tflops_per_device_causal=tflops_causal,
                      mfu=tflops / peak_tflops if peak_tflops else None,
                      mfu_causal=tflops_causal / peak_tflops if peak_tflops else None)
