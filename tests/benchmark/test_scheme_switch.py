"""``tools/benchmark.py --same-engine``: one LNS engine timed as LNS and as Pre-LN by switching its norms'
factors. Each switched scheme computes exactly what an engine of that scheme computes (fresh engines
of both schemes start from the same weights), and the options it cannot serve are refused up front."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.benchmark.gpu_summary import lns_ratio
from tests.tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/bench/tiny.yaml"

SCRIPT = """
import math, torch
from lnstrain.benchmark.runners import EngineRunner, SchemeSwitch, synthetic_micro_batches, with_norm_scheme
from lnstrain.config.run_config import load_config

config = load_config("configs/bench/tiny.yaml", ["train.compile=false"], 1, validate=False)
batches = synthetic_micro_batches(config, config.grad_accumulation_steps(1), 0)
cpu = torch.device("cpu")

def engine(scheme):
    return EngineRunner(scheme, with_norm_scheme(config, scheme), batches, cpu)

losses = {}
for scheme in ("pre_ln", "lns"):
    switch = SchemeSwitch(engine("lns"))
    runner = switch.as_scheme(scheme, scheme)
    losses[scheme] = [runner.step(), runner.step()]
    reference = engine(scheme)
    losses[scheme + " engine"] = [reference.step(), reference.step()]
    switch.set_scheme("lns")
    factors = sorted({round(norm.output_scale, 12) for norm, _ in switch.lns_factors})
    losses[scheme + " factors"] = factors
print("RESULT", repr(losses))
"""


def test_each_switched_scheme_computes_what_an_engine_of_that_scheme_does():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = ast.literal_eval(result.stdout.split("RESULT", 1)[1].strip())
    assert losses["pre_ln"] == losses["pre_ln engine"]  # bitwise, two steps
    assert losses["lns"] == losses["lns engine"]
    assert losses["pre_ln"] != losses["lns"]
    layers = 2  # the tiny config's: both norms of layer l get 1/sqrt(l)
    expected = sorted({round(1 / l ** 0.5, 12) for l in range(1, layers + 1)} - {1.0})
    assert losses["pre_ln factors"] == losses["lns factors"] == expected


@pytest.mark.parametrize("options,message", [
    (["--schemes", "lns,deepnorm"], "--same-engine times --schemes lns,pre_ln on --runner engine"),
    (["--schemes", "lns,pre_ln", "--runner", "model"], "--same-engine times --schemes lns,pre_ln on --runner engine"),
    (["--schemes", "lns,pre_ln", "--set", "train.compile=true"], "add --set train.compile=false"),
])
def test_what_one_engine_cannot_time_is_refused_before_anything_runs(options, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("benchmark").main(["--config", TINY, "--same-engine", "--baseline", "none", *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_report_names_both_schemes_of_the_one_engine(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "tools/benchmark.py", "--config", TINY, "--same-engine", "--schemes",
                             "lns,pre_ln", "--baseline", "none", "--set", "train.compile=false", "--warmup", "1",
                             "--steps", "3", "--json", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["runners"]] == ["lnstrain-engine[lns, one engine]",
                                                   "lnstrain-engine[pre_ln, one engine]"]
    assert [r["norm_scheme"] for r in doc["runners"]] == ["lns", "pre_ln"]
    assert doc["comparisons"][0]["pairs"] == 3
    assert lns_ratio(doc)[2] == 3  # the GPU check's summary reads the pair as LNS / Pre-LN
    assert doc["memory"]["runner_kind"] == "engine"
