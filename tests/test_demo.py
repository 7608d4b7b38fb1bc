"""launch/demo.sh as the README's quick start runs it: data stages, then a short training run whose
console names the right run directory, with the thread settings the docs recommend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_builds_its_data_and_trains_where_it_says(tmp_path):
    work = tmp_path / "work"
    calls = tmp_path / "python_calls.txt"
    python = tmp_path / "python"  # records the environment of every Python step, then runs it
    python.write_text(f'#!/bin/sh\necho "OMP_WAIT_POLICY=$OMP_WAIT_POLICY $*" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env |= {"PYTHON": str(python), "DEMO_WORKDIR": str(work)}
    done = subprocess.run(["bash", str(REPO / "launch" / "demo.sh"), "--set", "train.steps=2", "--set",
                           "train.eval_batches=1", "--set", "run.name=mine"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    steps = calls.read_text().splitlines()
    assert len(steps) == 5 and all(line.startswith("OMP_WAIT_POLICY=PASSIVE ") for line in steps), steps
    assert f"run directory {work / 'runs' / 'mine'}" in output
    assert "runs/demo" not in output
    assert "step 1/2 | loss" in output and "step 2/2 | loss" in output  # first and last, whatever the interval
    assert (work / "runs" / "mine" / "checkpoints" / "latest").is_file()
