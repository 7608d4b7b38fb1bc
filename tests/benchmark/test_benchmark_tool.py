"""tools/benchmark.py end to end on the tiny shape: the JSON has every field and sane values.

No timing assertions: the figures depend on the machine."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lnstrain.benchmark.report import REQUIRED_FIELDS, RUNNER_FIELDS, SCHEMA, is_complete
from lnstrain.estimate.flops import flops_per_token
from lnstrain.model.presets import model_preset
from tests.tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/bench/tiny.yaml"
IMPORTED_AT = time.monotonic()


def check_document(doc: dict, runner_names: list[str]) -> None:
    assert doc["schema"] == SCHEMA
    assert all(key in doc for key in REQUIRED_FIELDS)
    assert doc["shape"]["tokens_per_step"] == 4 * 16
    model = model_preset("tiny", vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, max_seq_len=32, make_vocab_size_divisible_by=64)
    assert doc["flops"]["per_token_noncausal"] == flops_per_token(model, 16).noncausal
    assert [run["name"] for run in doc["runners"]] == runner_names
    for run in doc["runners"]:
        assert all(key in run for key in RUNNER_FIELDS)
        timing, rate = run["step_time_s"], run["throughput"]
        assert len(timing["samples"]) == 2 and 0 < timing["min"] <= timing["median"] <= timing["max"]
        assert rate["tokens_per_s"] == pytest.approx(64 / timing["median"])
        assert len(run["cpu_time_s"]["samples"]) == 2 and run["cpu_time_s"]["median"] > 0
        assert rate["tflops_per_device"] > rate["tflops_per_device_causal"] > 0
        assert abs(run["last_loss"] - math.log(256)) < 1.0     # random init: about ln(vocabulary)
    assert [c["runner"] for c in doc["comparisons"]] == runner_names[1:]
    for comp in doc["comparisons"]:
        assert comp["ci95"][0] <= comp["median_ratio"] <= comp["ci95"][1] and comp["pairs"] == 2
        assert comp["cpu_time_ci95"][0] <= comp["cpu_time_median_ratio"] <= comp["cpu_time_ci95"][1]


def test_model_runner_in_process_with_mfu_from_given_peak(tmp_path, capsys):
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        doc = load_tool("benchmark").main(["--config", TINY, "--runner", "model", "--baseline", "none", "--schemes", "lns,pre_ln",
                                "--warmup", "1", "--steps", "2", "--peak-tflops", "1.0", "--threads", "1",
                                "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    check_document(doc, ["lnstrain-model[lns]", "lnstrain-model[pre_ln]"])
    run = doc["runners"][0]
    assert set(run["breakdown_s"]) == {"forward", "backward", "optimizer"}
    assert run["throughput"]["mfu"] == pytest.approx(run["throughput"]["tflops_per_device"] / 1.0)
    assert doc["peak"]["source"] == "--peak-tflops" and doc["environment"]["torch_threads"] == 1
    assert "lnstrain-model[lns]" in capsys.readouterr().out


def test_engine_runner_beside_the_hf_baseline(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "tools/benchmark.py", "--config", TINY, "--warmup", "2", "--steps", "2",
                             "--baseline", "hf", "--json", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    check_document(doc, ["lnstrain-engine[lns]", "hf-llama"])
    assert doc["runners"][0]["breakdown_s"] is None and doc["runners"][1]["breakdown_s"] is not None
    assert doc["peak"]["tflops"] is None and doc["runners"][0]["throughput"]["mfu"] is None
    assert doc["memory"]["runner_kind"] == "engine" and doc["memory"]["peak_rss_bytes"] > 0
    # two warm-up steps hold a steady one: the CPU estimate is within the dry run's 10% of the measured peak
    assert 0.9 <= doc["memory"]["estimate_over_measured"] <= 1.1, doc["memory"]


def test_bad_options_are_reported_together_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("benchmark").main(["--config", TINY, "--schemes", "lns,pre_nl", "--steps", "0", "--set", "train.micro_batch_size=3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown norm scheme 'pre_nl'" in err and "--steps >= 1" in err
    assert "train.global_batch_size (4) must be divisible by train.micro_batch_size" in err


def test_a_time_limit_stops_the_timed_steps_early_but_never_below_three(tmp_path):
    threads = torch.get_num_threads()
    try:
        doc = load_tool("benchmark").main(["--config", TINY, "--runner", "model", "--baseline", "none",
                                           "--warmup", "0", "--steps", "50", "--threads", "1", "--profile-steps", "2",
                                           "--time-limit-s", "0.001"])
    finally:
        torch.set_num_threads(threads)
    assert doc["protocol"]["timed_steps"] == 3 and doc["protocol"]["requested_steps"] == 50
    assert len(doc["runners"][0]["step_time_s"]["samples"]) == 3
    assert any("timed 3 of 50 steps" in note for note in doc["notes"])
    assert doc["profile"]["steps"] == 2  # taken first, before the timed steps: the time limit never drops it


def test_the_profile_is_on_disk_before_any_step_is_timed(tmp_path):
    out = tmp_path / "bench.json"
    tool = load_tool("benchmark")
    time_interleaved = tool.time_interleaved
    on_disk_before_timing = []

    def time_after_looking(*args, **kwargs):
        on_disk_before_timing.append(sorted(path.name for path in tmp_path.iterdir()))
        on_disk_before_timing.append(json.loads((tmp_path / "bench.profile.json").read_text()))
        return time_interleaved(*args, **kwargs)

    tool.time_interleaved = time_after_looking
    threads = torch.get_num_threads()
    try:
        doc = tool.main(["--config", TINY, "--runner", "model", "--baseline", "none", "--warmup", "0", "--steps", "3",
                         "--threads", "1", "--profile-steps", "1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    files, early = on_disk_before_timing
    assert files == ["bench.profile.json"]  # the report comes later, the profile first and whole
    assert early["profile"] == json.loads(json.dumps(doc["profile"])) and early["profile"]["rows"]
    assert early["schema"] == tool.PROFILE_SCHEMA and early["runner"] == doc["runners"][0]["name"]
    assert is_complete(json.loads(out.read_text()))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench.json", "bench.profile.json"]  # no temporary left


def test_the_command_line_counts_its_time_limit_from_the_process_start():
    # this process started before it imported this module (pytest's own imports came first)
    assert load_tool("benchmark").process_started() < IMPORTED_AT
