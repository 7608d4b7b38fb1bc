"""tools/benchmark_depth_stats.py times what the trainer does on an armed step, and reports what it measured."""

from __future__ import annotations

from lnstrain.analysis.depth_stats import DepthStatsCollector
from tests.tool_scripts import load_tool

TINY = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-heads", "2",
        "--vocab-size", "64", "--seq-len", "8", "--batch-size", "2", "--threads", "1"]


def test_an_armed_step_reads_the_parameter_gradients_before_the_optimizer_step(monkeypatch, capsys):
    tool = load_tool("benchmark_depth_stats")
    reads = []
    original = DepthStatsCollector.read_parameter_grads

    def read(self):
        reads.append(all(p.grad is not None for p in self.blocks[0].parameters()))  # gradients present: before the step
        original(self)

    monkeypatch.setattr(DepthStatsCollector, "read_parameter_grads", read)
    assert tool.main([*TINY, "--pairs", "2"]) == 0
    assert reads == [True] * (3 + 2)  # three warm-up pairs and two timed ones, each with one armed step
    assert "1 micro-batch," in capsys.readouterr().out


def test_a_negative_cost_is_printed_as_measured():
    tool = load_tool("benchmark_depth_stats")
    line = tool.cost_line("CPU time", [0.100, 0.100, 0.100], [0.098, 0.099, 0.097], [10])
    assert "armed step -2.00 ms (-2.0%)" in line and "interval 10: -0.200%" in line
    assert "negative: the machine's noise is larger than the cost" in line
    assert "armed step +1.00 ms" in tool.cost_line("CPU time", [0.1], [0.101], [10])
