"""``tools/benchmark.py --switches``: one engine timed as built and with each change of the default path left
out (``lnstrain/benchmark/switches.py``). A switched-off runner computes what an engine without that change
computes, switching back restores the default path, a change an engine does not have is skipped with the
reason, and the first runner's profile is on disk before anything else runs."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.benchmark.gpu_summary import lns_ratio
from lnstrain.benchmark.switches import SWITCHES, parse_switch_sets
from tests.tool_scripts import load_tool

ROOT = Path(__file__).resolve().parents[2]
TINY = "configs/bench/tiny.yaml"
BF16_ZERO1 = ["--set", "precision.dtype=bf16", "--set", "parallel.zero_stage=1", "--set", "train.compile=false"]

SCRIPT = """
import torch
from lnstrain.benchmark.runners import EngineRunner, SwitchBoard, synthetic_micro_batches, with_norm_scheme
from lnstrain.config.run_config import load_config
from lnstrain.model import build
from lnstrain.model.mlp import SwiGLUMLP
from lnstrain.model.rotary import RotaryEmbedding

config = load_config("configs/bench/tiny.yaml", ["train.compile=false", "precision.dtype=bf16", "parallel.zero_stage=1"],
                     1, validate=False)
batches = synthetic_micro_batches(config, config.grad_accumulation_steps(1), 0)
cpu = torch.device("cpu")
# the kernels cannot run on the CPU: taken as usable here, so that their switches can be turned
build.TRITON_KERNELS.update({name: (owner, lambda device, dtype: True) for name, (owner, _) in build.TRITON_KERNELS.items()})

def engine(scheme):
    return EngineRunner(scheme, with_norm_scheme(config, scheme), batches, cpu)

def state(board):
    module = board.runner.engine.module
    return {"fused": board.runner.engine.fused_accumulation.enabled,
            "rotary": {m.triton_kernel for m in module.modules() if isinstance(m, RotaryEmbedding)},
            "swiglu": {m.triton_kernel for m in module.modules() if isinstance(m, SwiGLUMLP)},
            "factors": sorted({round(m.output_scale, 9) for m in module.modules() if hasattr(m, "output_scale")})}

result = {}
names = ["lns_factor", "rotary_kernel", "swiglu_kernel", "fused_accumulation"]
board = SwitchBoard(engine("lns"), names)
for name, off in (("default", ()), ("no kernels", ("rotary_kernel", "swiglu_kernel")),
                  ("deepspeed add", ("fused_accumulation",)), ("pre_ln", ("lns_factor",)), ("default again", ())):
    runner = board.runner_for(name, off)
    result[name] = {"loss": runner.step(), "scheme": runner.scheme, **state(board)}
reference = engine("lns")
result["lns engine"] = [reference.step() for _ in range(3)]
pre_ln = SwitchBoard(engine("lns"), names).runner_for("pre_ln", ("lns_factor",))
result["pre_ln runner"] = [pre_ln.step() for _ in range(2)]
reference = engine("pre_ln")
result["pre_ln engine"] = [reference.step() for _ in range(2)]
print("RESULT", repr(result))
"""


LOSS_AND_FP8 = """
from lnstrain.benchmark.runners import EngineRunner, SwitchBoard, synthetic_micro_batches
from lnstrain.config.run_config import load_config
from lnstrain.parallel.layers import ShardedWeightLayer
import torch

def config(*overrides):
    return load_config("configs/bench/tiny.yaml", ["train.compile=false", "precision.dtype=bf16",
                       "parallel.zero_stage=1", *overrides], 1, validate=False)

built = config("precision.fp8=tensorwise")
batches = synthetic_micro_batches(built, built.grad_accumulation_steps(1), 0)

def engine(configured):
    return EngineRunner("engine", configured, batches, torch.device("cpu"))

def state(board):
    engine = board.runner.engine
    return {"loss": engine.config.model.cross_entropy,
            "fp8": sorted({str(m.fp8) for m in engine.module.modules() if isinstance(m, ShardedWeightLayer)})}

result = {}
for name, off in (("no fp8", ("fp8",)), ("fp32 logits", ("chunked_loss",)), ("default", ())):
    board = SwitchBoard(engine(config("precision.fp8=tensorwise")), ["chunked_loss", "fp8"])  # its own config
    runner = board.runner_for(name, off)
    result[name] = {"losses": [runner.step() for _ in range(2)], **state(board)}
for name, overrides in (("bf16 engine", ()), ("fp32 logits engine", ("precision.fp8=tensorwise",
                                                                    "model.cross_entropy=fp32_logits")),
                        ("fp8 engine", ("precision.fp8=tensorwise",))):
    reference = engine(config(*overrides))
    result[name] = [reference.step() for _ in range(2)]
without = SwitchBoard(engine(config()), ["chunked_loss", "fp8"])
result["unavailable"] = without.unavailable
print("RESULT", repr(result))
"""


@pytest.mark.slow
def test_the_loss_and_fp8_switches_compute_what_an_engine_built_without_them_computes():
    """An engine built with ``precision.fp8: tensorwise`` and the chunked loss, stepped with FP8 switched off,
    gives a bf16 engine's losses bit for bit; with the chunked loss switched off, an fp32-logits engine's; both
    on, its own. An engine without float8 cannot switch FP8 off and says why."""
    steps = _result_of(LOSS_AND_FP8)
    assert steps["no fp8"]["losses"] == steps["bf16 engine"] and steps["no fp8"]["fp8"] == ["None"]
    assert steps["fp32 logits"]["losses"] == steps["fp32 logits engine"]
    assert steps["fp32 logits"]["loss"] == "fp32_logits"
    assert steps["default"]["losses"] == steps["fp8 engine"] != steps["bf16 engine"]
    assert steps["default"]["loss"] == "chunked" and len(steps["default"]["fp8"]) == 2  # blocks' and the head's
    assert steps["unavailable"]["chunked_loss"] is None and "precision.fp8" in steps["unavailable"]["fp8"]


def _result_of(script: str) -> dict:
    """What ``script`` prints after RESULT, run in a fresh interpreter (its own one-rank process group)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.split("RESULT", 1)[1].strip())


@pytest.mark.slow
def test_each_switch_turns_its_change_off_and_back_on_and_computes_what_the_engine_would():
    steps = _result_of(SCRIPT)
    default = steps["default"]
    assert default["fused"] and default["rotary"] == default["swiglu"] == {True} and default["scheme"] == "lns"
    assert steps["pre_ln"]["factors"] == [1.0] and steps["pre_ln"]["scheme"] == "pre_ln"
    assert len(default["factors"]) == 2  # 1 and 1/sqrt(2): the tiny model's two layers
    assert steps["no kernels"]["rotary"] == steps["no kernels"]["swiglu"] == {False} and steps["no kernels"]["fused"]
    assert not steps["deepspeed add"]["fused"] and steps["deepspeed add"]["rotary"] == {True}
    assert steps["default again"] == {**default, "loss": steps["default again"]["loss"]}
    # with a kernel or the fused add off, the engine computes the default path's numbers (on the CPU the
    # kernels' custom ops run the eager ops, bitwise the plain ones): three steps of a fresh LNS engine
    assert [steps[name]["loss"] for name in ("default", "no kernels", "deepspeed add")] == steps["lns engine"]
    assert steps["pre_ln runner"] == steps["pre_ln engine"]  # LNS's factor off: a Pre-LN engine, bit for bit


@pytest.mark.slow
def test_the_report_times_each_change_on_one_engine_and_keeps_the_profile_first(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "tools/benchmark.py", "--config", TINY, "--baseline", "none", *BF16_ZERO1,
                             "--switches", "lns_factor,rotary_kernel,fused_accumulation", "--warmup", "2", "--steps", "3",
                             "--profile-steps", "1", "--json", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["runners"]] == ["lnstrain-engine[lns]", "lnstrain-engine[lns] without lns_factor",
                                                   "lnstrain-engine[lns] without fused_accumulation"]
    assert [c["pairs"] for c in doc["comparisons"]] == [3, 3]
    assert lns_ratio(doc)[2] == 3  # the GPU check reads LNS / Pre-LN from the switched pair
    assert any("without rotary_kernel skipped: rotary_kernel: the rotary Triton kernel is not used on cpu" in note
               for note in doc["notes"])
    assert doc["switches"]["off_by_runner"]["lnstrain-engine[lns] without fused_accumulation"] == ["fused_accumulation"]
    early = json.loads((tmp_path / "bench.profile.json").read_text())
    assert early["profile"] == doc["profile"] and early["runner"] == "lnstrain-engine[lns]"
    assert early["profile"]["rows"]


BROKEN = """
import sys
from lnstrain.benchmark import switches
from tests.tool_scripts import load_tool

def broken(engine, on):  # turned on before each step of the first runner, off for the second
    if not on:
        raise RuntimeError("switch failed")

switches.SWITCHES["broken"] = switches.Switch("broken", "nothing", lambda engine: None, broken)
load_tool("benchmark").main(sys.argv[1:])
"""


@pytest.mark.slow
def test_the_profile_is_on_disk_when_a_later_runner_fails(tmp_path):
    """A switch that fails when the second runner turns it off ends the benchmark; the first runner's profile,
    taken before, is kept."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", BROKEN, "--config", TINY, "--baseline", "none", "--set",
                             "train.compile=false", "--switches", "broken", "--warmup", "1", "--steps", "2",
                             "--profile-steps", "1", "--json", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "switch failed" in result.stderr
    assert not out.exists()
    assert json.loads((tmp_path / "bench.profile.json").read_text())["profile"]["rows"]


@pytest.mark.parametrize("options,message", [
    (["--switches", "rotary_kernel,warp_drive"], "--switches: unknown warp_drive"),
    (["--switches", "rotary_kernel", "--runner", "model"], "--switches times one engine"),
    (["--switches", "rotary_kernel", "--schemes", "lns,pre_ln"], "--switches times one engine"),
])
def test_what_the_switches_cannot_time_is_refused_before_anything_runs(options, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_tool("benchmark").main(["--config", TINY, "--baseline", "none", *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_switch_sets_and_the_registry():
    assert parse_switch_sets("a, b+c ,,d") == [("a",), ("b", "c"), ("d",)]
    assert set(SWITCHES) >= {"lns_factor", "rotary_kernel", "swiglu_kernel", "fused_accumulation", "chunked_loss",
                             "fp8"}
    assert all(switch.without for switch in SWITCHES.values())
