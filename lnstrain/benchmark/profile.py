"""Where a step's time goes: a few steps of one runner under ``torch.profiler``, by operator or kernel.

On CUDA the rows are the device's own events (kernels, copies, memsets) by self device time, so that
they add up to the GPU's busy time (the CPU-side operators that launched them carry the same time
again and are left out); on the CPU the operators by self CPU time. ``tools/benchmark.py --profile-steps N`` puts the table in
its JSON (``profile``), so that a run that misses its MFU goal already says what to look at.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile


def _self_time_us(event: Any, on_device: bool) -> float:
    if not on_device:
        return float(event.self_cpu_time_total)
    # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def _runs_on_the_device(event: Any) -> bool:
    """A kernel, copy or memset (``DeviceType.CUDA``), not a CPU operator."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def profile_steps(step: Callable[[], Any], steps: int, device: torch.device, top: int = 25) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the profiler; the ``top`` rows by self time, per step."""
    if steps < 1:
        raise ValueError(f"profile_steps needs steps >= 1 (got {steps})")
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        if on_device:
            torch.cuda.synchronize(device)
    events = list(profiler.key_averages())
    if on_device and any(_runs_on_the_device(event) for event in events):
        events = [event for event in events if _runs_on_the_device(event)]
    timed = [(event, _self_time_us(event, on_device)) for event in events]
    timed = [(event, us) for event, us in timed if us > 0]
    total_us = sum(us for _, us in timed)
    timed.sort(key=lambda item: item[1], reverse=True)
    rows = [{"name": event.key, "calls_per_step": event.count / steps, "self_ms_per_step": us / steps / 1e3,
             "percent": 100.0 * us / total_us} for event, us in timed[:top]]
    return {"steps": steps, "sort_by": "self device time" if on_device else "self CPU time",
            "total_ms_per_step": total_us / steps / 1e3, "rows": rows}


def format_profile(profile_section: dict[str, Any], lines: int = 10) -> list[str]:
    """The first ``lines`` rows as text."""
    header = (f"profile ({profile_section['steps']} steps, by {profile_section['sort_by']}, "
              f"{profile_section['total_ms_per_step']:.2f} ms per step in all):")
    return [header] + [f"  {row['percent']:5.1f}%  {row['self_ms_per_step']:8.3f} ms  {row['calls_per_step']:6.1f}x  "
                       f"{row['name'][:90]}" for row in profile_section["rows"][:lines]]
