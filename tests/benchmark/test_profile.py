"""tools/benchmark.py --profile-steps: the operators of the first runner's steps, by self time."""

import pytest
import torch

from lnstrain.benchmark.profile import breakdown, profile_steps, summarize_events
from tests.tool_scripts import load_tool


def test_profile_of_the_first_runner_is_in_the_report(tmp_path):
    threads = torch.get_num_threads()
    try:
        doc = load_tool("benchmark").main(["--config", "configs/bench/tiny.yaml", "--runner", "model", "--baseline", "none",
                                           "--warmup", "1", "--steps", "1", "--threads", "1", "--profile-steps", "2"])
    finally:
        torch.set_num_threads(threads)
    profile = doc["profile"]
    assert profile["steps"] == 2 and profile["sort_by"] == "self CPU time"
    names = [row["name"] for row in profile["rows"]]
    assert "aten::mm" in names  # the matmuls of a training step
    percents = [row["percent"] for row in profile["rows"]]
    assert percents == sorted(percents, reverse=True) and 0 < sum(percents) <= 100.0 + 1e-6


def test_profile_needs_a_step():
    with pytest.raises(ValueError, match="steps >= 1"):
        profile_steps(lambda: None, 0, torch.device("cpu"))


class _Event:
    """What ``key_averages()`` gives for one name: enough of a ``FunctionEventAvg`` for ``summarize_events``."""

    def __init__(self, key, device_us, count=1, device=True, annotation=False):
        self.key, self.count, self.is_user_annotation = key, count, annotation
        self.device_type = "DeviceType.CUDA" if device else "DeviceType.CPU"
        self.self_device_time_total, self.self_cpu_time_total = device_us, 5.0


def test_a_device_annotation_is_not_counted_beside_the_kernels_it_spans():
    # one optimizer step: its annotation spans the two fused-Adam launches (14 ms), which count once
    events = [_Event("nvjet_sm90_tst_256x128", 60_000.0, count=10), _Event("multi_tensor_apply_kernel", 14_000.0, count=2),
              _Event("Optimizer.step#AdamW.step", 14_100.0, annotation=True),
              _Event("void at::native::vectorized_elementwise_kernel<8>", 26_000.0, count=7),
              _Event("aten::mm", 0.0, device=False)]
    section = summarize_events(events, steps=2, on_device=True)
    assert section["total_ms_per_step"] == pytest.approx(50.0)  # (60 + 14 + 26) / 2, not 57.05
    assert [row["name"] for row in section["rows"]] == ["nvjet_sm90_tst_256x128", "void at::native::vectorized_elementwise_kernel<8>",
                                                        "multi_tensor_apply_kernel"]
    assert sum(row["percent"] for row in section["rows"]) == pytest.approx(100.0)
    assert section["categories_ms_per_step"] == pytest.approx({"gemm": 30.0, "elementwise": 13.0, "optimizer": 7.0})
    assert section["annotations_left_out"] == ["Optimizer.step#AdamW.step"]


def test_an_annotation_is_recognised_by_name_where_the_event_does_not_say():
    events = [_Event("gemm_kernel", 1000.0), _Event("Optimizer.step#Adam.step", 900.0)]
    for event in events:
        del event.is_user_annotation  # a torch without the attribute
    assert summarize_events(events, steps=1, on_device=True)["total_ms_per_step"] == pytest.approx(1.0)


def test_a_stored_profile_is_read_again_without_its_double_count():
    stored = {"steps": 1, "sort_by": "self device time", "total_ms_per_step": 110.0,
              "rows": [{"name": "nvjet_x", "calls_per_step": 4, "self_ms_per_step": 60.0, "percent": 54.5},
                       {"name": "Optimizer.step#Adam.step", "calls_per_step": 1, "self_ms_per_step": 10.0, "percent": 9.1},
                       {"name": "multi_tensor_apply_kernel", "calls_per_step": 1, "self_ms_per_step": 9.5, "percent": 8.6},
                       {"name": "elementwise_kernel<add>", "calls_per_step": 9, "self_ms_per_step": 20.0, "percent": 18.2}]}
    result = breakdown(stored, step_time_s=0.125)
    assert result["busy_ms_per_step"] == pytest.approx(100.0)
    assert result["busy_percent_of_step"] == pytest.approx(80.0)
    assert result["unlisted_ms"] == pytest.approx(10.5)  # 100 busy - 89.5 in the listed rows
    assert result["categories_percent_of_step"]["gemm"] == pytest.approx(48.0)
    assert [row["name"] for row in result["rows"]] == ["nvjet_x", "multi_tensor_apply_kernel", "elementwise_kernel<add>"]


def test_the_committed_h100_profile_read_again():
    """The figures docs/performance.md gives for the first H100 call, from its committed profile."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parents[2] / "docs/gpu_check/h100_2026-11-26_call1/gpu_check.json")
                     .read_text(encoding="utf-8"))
    report = doc["items"]["1b_eager"]["report"]
    result = breakdown(report["profile"], report["runners"][0]["step_time_s"]["median"])
    assert result["annotation_ms_left_out"] == pytest.approx(-14.685, abs=1e-3)
    assert result["busy_percent_of_step"] == pytest.approx(96.8, abs=0.1)
    assert result["categories_ms_per_step"]["gemm"] == pytest.approx(677.1, abs=0.1)
    assert result["categories_percent_of_step"]["gemm"] == pytest.approx(48.4, abs=0.1)
    assert result["categories_percent_of_step"]["elementwise"] == pytest.approx(28.7, abs=0.1)
