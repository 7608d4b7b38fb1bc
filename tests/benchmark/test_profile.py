"""tools/benchmark.py --profile-steps: the operators of the first runner's steps, by self time."""

import pytest
import torch

from lnstrain.benchmark.profile import profile_steps
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
