"""The offline install the GPU check depends on, proven here: a wheelhouse built by
tools/build_wheelhouse.py, installed by launch/install_wheelhouse.sh with ``pip --no-index`` into a fresh
environment that has only torch (and what torch itself requires), imports DeepSpeed and builds an engine
whose first step gives this environment's loss bit for bit.

The wheelhouse is built for this interpreter with nothing excluded but torch (the GPU check's is built for
the GPU image's Python 3.12 and leaves out what that image has), so the downloads need the package index
(this machine's and CI's registry); the install and the engine need none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

ENGINE_STEP = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import deepspeed, torch
from lnstrain.benchmark.runners import EngineRunner, synthetic_micro_batches
from lnstrain.config.run_config import load_config
config = load_config("configs/bench/tiny.yaml", ["parallel.zero_stage=1"], 1, validate=False)
runner = EngineRunner("wheelhouse", config, synthetic_micro_batches(config, 2, 0), torch.device("cpu"))
print(json.dumps({{"loss": runner.step(), "deepspeed": deepspeed.__file__}}))
"""


def requirement_closure(name: str) -> set[str]:
    """``name`` and every distribution it requires, recursively, as installed here (markers evaluated,
    the extras each requirement asks for included: torch's CUDA build needs cuda-toolkit[cudart, ...])."""
    found: dict[str, set[str]] = {}
    todo: list[tuple[str, set[str]]] = [(name, set())]
    while todo:
        wanted, extras = todo.pop()
        dist = metadata.distribution(wanted)
        key = dist.metadata["Name"].lower()
        if key in found and extras <= found[key]:
            continue
        found[key] = found.get(key, set()) | extras
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": extra})
                                                 for extra in {""} | found[key]):
                todo.append((requirement.name, set(requirement.extras)))
    return set(found)


def only_torch_environment(path: Path) -> Path:
    """A new virtual environment (with pip) whose site-packages links torch's closure from this one."""
    venv.EnvBuilder(with_pip=True).create(path)
    python = path / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    here = Path(sysconfig.get_path("purelib"))
    for name in requirement_closure("torch"):
        for file in metadata.distribution(name).files or []:
            top = Path(file).parts[0]
            if top != ".." and not (site / top).exists() and (here / top).exists():
                (site / top).symlink_to(here / top)
    return python


@pytest.mark.slow
def test_the_wheelhouse_installs_offline_beside_torch_and_builds_an_engine(tmp_path):
    python = only_torch_environment(tmp_path / "env")
    bare = subprocess.run([python, "-c", "import torch; import deepspeed"], capture_output=True, text=True)
    assert "No module named 'deepspeed'" in bare.stderr  # the environment really has torch and not DeepSpeed

    wheelhouse = tmp_path / "wheelhouse"
    built = subprocess.run([sys.executable, "tools/build_wheelhouse.py", "--for-this-python", "--exclude", "torch",
                            "--output", str(wheelhouse)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert (wheelhouse / "requirements.txt").read_text().splitlines()[0].startswith("deepspeed==")
    assert not list(wheelhouse.glob("torch-*.whl"))

    offline = {**os.environ, "PYTHON": str(python), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse),
               "PIP_CONFIG_FILE": os.devnull}
    installed = subprocess.run(["bash", "launch/install_wheelhouse.sh", str(wheelhouse), str(tmp_path / "prefix")],
                               cwd=ROOT, capture_output=True, text=True, timeout=600, env=offline)
    assert installed.returncode == 0, installed.stderr[-3000:]
    exports = installed.stdout.strip().splitlines()[-1]
    assert exports.startswith("export PYTHONPATH=")

    step = subprocess.run(["bash", "-c", f"{exports}; exec \"$0\" -c \"$1\"", str(python), ENGINE_STEP], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert step.returncode == 0, step.stderr[-3000:]
    result = json.loads(step.stdout.strip().splitlines()[-1])
    assert str(tmp_path / "prefix") in result["deepspeed"]  # DeepSpeed from the wheelhouse, not this environment's

    here = subprocess.run([sys.executable, "-c", ENGINE_STEP], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert here.returncode == 0, here.stderr[-3000:]
    assert result["loss"] == json.loads(here.stdout.strip().splitlines()[-1])["loss"]
