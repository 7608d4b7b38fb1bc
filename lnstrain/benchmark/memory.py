"""Peak memory of a benchmark run, next to the ``--dry-run`` estimate.

On CUDA the measured figure is ``torch.cuda.max_memory_allocated`` (tensors only; ``reserved`` adds
the caching allocator's slack), taken over the first runner's build, warm-up and steps before any
other runner exists. The estimate (``lnstrain.estimate.memory``) models the DeepSpeed engine's
states (16-bit weights, fp32 master copy and moments, ZeRO sharding) and 16-bit activations, so the
comparison is made for the ``engine`` runner only. On the CPU only the process's resident-set high
water mark is available, which also counts the Python runtime and every library.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from lnstrain.config.run_config import Config
from lnstrain.estimate.memory import memory_estimate


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Measured peaks in bytes."""
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}


def memory_report(config: Config, world_size: int, device: torch.device, runner_kind: str,
                  measured: dict[str, Any]) -> dict[str, Any]:
    """Measured peaks, the estimate for the configured checkpointing mode and their ratio."""
    mode = config.train.activation_checkpointing
    estimated = memory_estimate(config, world_size).total_with(mode)
    report: dict[str, Any] = {"runner_kind": runner_kind, "activation_checkpointing": mode,
                              "estimated_bytes": estimated, **measured}
    comparable = device.type == "cuda" and runner_kind == "engine"
    if comparable:
        report["estimate_over_measured"] = estimated / measured["peak_allocated_bytes"]
        report["note"] = "peak allocated on the first runner alone; the estimate excludes the CUDA context"
    else:
        why = "no CUDA allocator statistics on the CPU" if device.type != "cuda" else (
            f"the estimate models the DeepSpeed engine, not the {runner_kind!r} runner's fp32 weights + autocast")
        report["estimate_over_measured"] = None
        report["note"] = f"not compared: {why}"
    return report
