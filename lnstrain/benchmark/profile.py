"""Where a step's time goes: a few steps of one runner under ``torch.profiler``, by operator or kernel.

On CUDA the rows are the device's own events (kernels, copies, memsets) by self device time, so that
they add up to the GPU's busy time (the CPU-side operators that launched them carry the same time
again and are left out); on the CPU the operators by self CPU time. ``tools/benchmark.py --profile-steps N`` puts the table in
its JSON (``profile``), so that a run that misses its MFU goal already says what to look at.

A ``record_function`` region (the optimizer's ``Optimizer.step#AdamW.step`` among them) also appears
on the device's timeline as a *user annotation* spanning the kernels launched inside it; its "self"
time is that span, which the kernels already count. Such events are left out of the rows and the
total (before this was done, the H100 profile of docs/gpu_check/h100_2026-11-26_call1 counted the
optimizer's 14.7 ms twice). ``categories`` sums every counted event, not only the listed rows, by
what it is (``kernel_category``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

ANNOTATION_PREFIXES = ("Optimizer.", "ProfilerStep#")
"""Names of the ``record_function`` regions torch itself opens; recognised by name where an event does not
say whether it is an annotation (a stored profile's rows, or a torch without ``is_user_annotation``)."""

CATEGORIES = (
    ("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "sm80_xmma", "ampere_", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("sdpa", "flash", "fmha", "attention", "compute_dot_do_o")),
    ("norm", ("layer_norm", "rms_norm", "gammabetabackward", "rmsnorm")),
    ("optimizer", ("multi_tensor_apply", "fusedoptimizer", "adam")),
    ("loss", ("softmax", "nll_loss", "cross_entropy")),
    ("communication", ("nccl", "allreduce", "all_reduce", "reduce_scatter", "allgather")),
    ("memcpy and memset", ("memcpy", "memset")),
    ("elementwise", ("elementwise", "triton_", "_kernel")),
)
"""(category, lower-case substrings) in order of precedence: the first that matches names the event."""


def kernel_category(name: str) -> str:
    """What a kernel or operator is, from its name: one of ``CATEGORIES``' names, or ``other``."""
    lowered = name.lower()
    for category, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return category
    return "other"


def _self_time_us(event: Any, on_device: bool) -> float:
    if not on_device:
        return float(event.self_cpu_time_total)
    # torch >= 2.4 names it self_device_time_total; older releases self_cuda_time_total
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def _runs_on_the_device(event: Any) -> bool:
    """A kernel, copy or memset (``DeviceType.CUDA``), not a CPU operator."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def is_annotation(event: Any) -> bool:
    """Whether ``event`` is a ``record_function`` region rather than work of its own."""
    flag = getattr(event, "is_user_annotation", None)
    return bool(flag) or str(getattr(event, "key", "")).startswith(ANNOTATION_PREFIXES)


def summarize_events(events: list[Any], steps: int, on_device: bool, top: int = 25) -> dict[str, Any]:
    """The profile section from ``key_averages()``'s events: on the device only its own events, never an
    annotation; the ``top`` rows by self time, per step, and every counted event's time by category."""
    if on_device and any(_runs_on_the_device(event) for event in events):
        events = [event for event in events if _runs_on_the_device(event)]
    annotations = [event for event in events if is_annotation(event)] if on_device else []
    timed = [(event, _self_time_us(event, on_device)) for event in events if not (on_device and is_annotation(event))]
    timed = [(event, us) for event, us in timed if us > 0]
    total_us = sum(us for _, us in timed)
    timed.sort(key=lambda item: item[1], reverse=True)
    rows = [{"name": event.key, "calls_per_step": event.count / steps, "self_ms_per_step": us / steps / 1e3,
             "percent": 100.0 * us / total_us} for event, us in timed[:top]]
    categories: dict[str, float] = {}
    for event, us in timed:
        category = kernel_category(event.key)
        categories[category] = categories.get(category, 0.0) + us / steps / 1e3
    return {"steps": steps, "sort_by": "self device time" if on_device else "self CPU time",
            "total_ms_per_step": total_us / steps / 1e3, "rows": rows,
            "categories_ms_per_step": dict(sorted(categories.items(), key=lambda item: -item[1])),
            "annotations_left_out": sorted({event.key for event in annotations})}


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
    return summarize_events(list(profiler.key_averages()), steps, on_device, top)


def breakdown(profile_section: dict[str, Any], step_time_s: float | None = None) -> dict[str, Any]:
    """A stored profile section read again: its rows without annotations (a profile written before they
    were left out counted them), the device's busy time per step and, given the step's time, the share of
    the step each category and the busy time take. Categories come from the stored rows alone when the
    section has none of its own (then ``unlisted_ms`` is the busy time no listed row accounts for)."""
    annotations = [row for row in profile_section["rows"] if row["name"].startswith(ANNOTATION_PREFIXES)]
    rows = [row for row in profile_section["rows"] if row not in annotations]
    busy_ms = profile_section["total_ms_per_step"] - sum(row["self_ms_per_step"] for row in annotations)
    categories = profile_section.get("categories_ms_per_step")
    unlisted_ms = 0.0
    if categories is None:
        categories = {}
        for row in rows:
            category = kernel_category(row["name"])
            categories[category] = categories.get(category, 0.0) + row["self_ms_per_step"]
        unlisted_ms = busy_ms - sum(categories.values())
    result: dict[str, Any] = {"busy_ms_per_step": busy_ms, "annotation_ms_left_out": busy_ms - profile_section["total_ms_per_step"],
                              "categories_ms_per_step": categories, "unlisted_ms": unlisted_ms,
                              "rows": [dict(row, percent=100.0 * row["self_ms_per_step"] / busy_ms) for row in rows]}
    if step_time_s:
        step_ms = step_time_s * 1e3
        result["step_ms"] = step_ms
        result["busy_percent_of_step"] = 100.0 * busy_ms / step_ms
        result["categories_percent_of_step"] = {name: 100.0 * ms / step_ms for name, ms in categories.items()}
    return result


def format_profile(profile_section: dict[str, Any], lines: int = 10) -> list[str]:
    """The first ``lines`` rows as text, and the time by category where the section has it."""
    header = (f"profile ({profile_section['steps']} steps, by {profile_section['sort_by']}, "
              f"{profile_section['total_ms_per_step']:.2f} ms per step in all):")
    text = [header] + [f"  {row['percent']:5.1f}%  {row['self_ms_per_step']:8.3f} ms  {row['calls_per_step']:6.1f}x  "
                       f"{row['name'][:90]}" for row in profile_section["rows"][:lines]]
    categories = profile_section.get("categories_ms_per_step")
    if categories:
        text.append("  by category: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in categories.items()))
    return text
