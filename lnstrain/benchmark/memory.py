"""Peak memory of a benchmark run, next to the ``--dry-run`` estimate.

On CUDA the measured figure is ``torch.cuda.max_memory_allocated`` (tensors only; ``reserved`` adds
the caching allocator's slack), taken over the first runner's build and warm-up steps before any
other runner exists. The first step holds less than the later ones (Adam's moments and DeepSpeed's
fp32 copies appear in its optimizer step), so only a warm-up of two steps or more contains a steady
step; with fewer, the figures are reported but not compared with the estimate. The estimate (``lnstrain.estimate.memory``) models the DeepSpeed engine's
states (16-bit weights, fp32 master copy and moments, ZeRO sharding) and 16-bit activations, so the
comparison is made for the ``engine`` runner only. Elsewhere (the CPU) the first runner's build and
warm-up steps run under ``LiveTensorBytes``, whose peak of live tensor bytes stands in for the CUDA
figure (the resident-set high-water mark is recorded too, but it also counts the Python runtime and
every library). The CPU then measures the same engine with torch's CPU kernels: the same tensors
except what differs between the CPU and the CUDA kernels' own workspaces.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from lnstrain.benchmark.tensor_memory import LiveTensorBytes
from lnstrain.config.run_config import Config
from lnstrain.estimate.memory import memory_estimate


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def tensor_tracker(device: torch.device) -> LiveTensorBytes | None:
    """A live-tensor-bytes tracker where the device has no allocator statistics (not CUDA)."""
    return None if device.type == "cuda" else LiveTensorBytes()


def peak_memory(device: torch.device, tracker: Any = None) -> dict[str, Any]:
    """Measured peaks in bytes."""
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    measured = {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}
    if isinstance(tracker, LiveTensorBytes):
        measured["peak_tensor_bytes"] = tracker.peak
    return measured


STEADY_WARMUP_STEPS = 2
"""Warm-up steps needed before the measured peak includes a steady step."""


def memory_report(config: Config, world_size: int, device: torch.device, runner_kind: str,
                  measured: dict[str, Any], warmup_steps: int = STEADY_WARMUP_STEPS) -> dict[str, Any]:
    """Measured peaks, the estimate for the configured checkpointing mode and their ratio."""
    mode = config.train.activation_checkpointing
    estimated = memory_estimate(config, world_size, device="cuda" if device.type == "cuda" else "cpu").total_with(mode)
    report: dict[str, Any] = {"runner_kind": runner_kind, "activation_checkpointing": mode,
                              "estimated_bytes": estimated, "warmup_steps": warmup_steps, **measured}
    peak = measured.get("peak_allocated_bytes", measured.get("peak_tensor_bytes"))
    if runner_kind == "engine" and peak and warmup_steps < STEADY_WARMUP_STEPS:
        report["estimate_over_measured"] = None
        report["note"] = (f"not compared: {warmup_steps} warm-up step(s) hold no steady step (Adam's state appears in "
                          f"the first); use --warmup {STEADY_WARMUP_STEPS} or more")
    elif runner_kind == "engine" and peak:
        report["estimate_over_measured"] = estimated / peak
        report["note"] = ("peak allocated on the first runner alone; the estimate excludes the CUDA context"
                          if device.type == "cuda" else
                          "peak live tensor bytes over the first runner's build and warm-up steps (LiveTensorBytes); "
                          "the estimate is for the CPU's kernels")
    else:
        why = "no peak measured (no warm-up steps?)" if not peak else (
            f"the estimate models the DeepSpeed engine, not the {runner_kind!r} runner's fp32 weights + autocast")
        report["estimate_over_measured"] = None
        report["note"] = f"not compared: {why}"
    return report
