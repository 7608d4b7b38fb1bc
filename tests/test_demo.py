"""launch/demo.sh as launch/train.sh runs it: data stages, then a short training run whose console names
the right run directory, with the thread settings the docs recommend; with two ranks, Ctrl-C saves."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lnstrain.checkpoint.metadata import COMPLETE_MARKER
from lnstrain.run_files import RUN_LOG_FILE
from lnstrain.testing.distributed import free_port
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, build_tiny_corpus, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


@pytest.mark.multirank
@pytest.mark.slow
def test_ctrl_c_through_the_deepspeed_launcher_saves_every_rank_and_says_how_to_resume(tmp_path):
    """NUM_RANKS=2 with a config of one's own: the terminal's SIGINT reaches launch/slurm/preemptible.py,
    which asks the ranks to save (SIGUSR1); they stop after the same step, exit 75, and the launcher's
    own line about it is filtered."""
    corpus = build_tiny_corpus(tmp_path / "corpus")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"NUM_RANKS": "2", "MASTER_PORT": str(free_port())}
    args = ["--config", str(TINY_RUN_CONFIG)]
    for override in tiny_run_overrides(corpus, tmp_path / "runs") + ["train.steps=200", "checkpoint.interval_steps=0"]:
        args += ["--set", override]
    demo = subprocess.Popen(["bash", "launch/demo.sh", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # a terminal's group
    lines = []
    try:
        for line in demo.stdout:
            lines.append(line)
            if "step 1/200 |" in line:
                os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C
        assert demo.wait(timeout=120) == EXIT_STOPPED, "".join(lines)[-3000:]
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    output = "".join(lines)
    assert "== training (the config given; no demo data needed)" in output and "demo corpus" not in output
    assert "preemptible: got SIGINT; asking every rank to save and stop" in output
    assert "Traceback" not in output and "exits with return code" not in output, output[-3000:]
    [note] = [line for line in lines if line.startswith("lnstrain: stopped to be resumed")]  # rank 0's, once
    stopped = re.fullmatch(r"lnstrain: stopped to be resumed after step (\d+) of 200 \(received SIGUSR1\); checkpoint "
                           r"(\S+); to continue, rerun: (.*)\n", note)
    assert stopped, note
    assert shlex.split(stopped.group(3)) == ["NUM_RANKS=2", "bash", "launch/demo.sh", *args]
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"global_step{stopped.group(1)}"
    assert Path(stopped.group(2)) == checkpoints / f"global_step{stopped.group(1)}"
    assert (checkpoints / f"global_step{stopped.group(1)}" / COMPLETE_MARKER).is_file()


@pytest.mark.multirank
@pytest.mark.slow
def test_ctrl_c_through_tee_and_the_deepspeed_launcher_saves_and_exits_75_when_tee_dies_of_it(tmp_path):
    """``NUM_RANKS=2 bash launch/demo.sh ... 2>&1 | tee`` and Ctrl-C to the whole group, as a terminal sends
    it: tee dies, and nothing upstream of it (ranks, launcher, wrapper, the script) dies of its pipe."""
    corpus = build_tiny_corpus(tmp_path / "corpus")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"NUM_RANKS": "2", "MASTER_PORT": str(free_port())}
    args = ["--config", str(TINY_RUN_CONFIG)]
    for override in tiny_run_overrides(corpus, tmp_path / "runs") + ["train.steps=200", "checkpoint.interval_steps=0",
                                                                      "logging.interval=1"]:
        args += ["--set", override]
    console, status = tmp_path / "console.txt", tmp_path / "status"
    command = f"{{ bash launch/demo.sh {shlex.join(args)}; echo $? > {status}; }} 2>&1 | tee {console}"
    group = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             start_new_session=True)  # a terminal's foreground group
    try:
        give_up = time.monotonic() + 300
        while "step 1/200 |" not in (console.read_text() if console.is_file() else ""):
            assert time.monotonic() < give_up and group.poll() is None, console.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(group.pid, signal.SIGINT)  # Ctrl-C: tee dies of it
        group.wait(timeout=180)
        while not status.is_file() and time.monotonic() < give_up:
            time.sleep(0.2)
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
    assert status.read_text().strip() == str(EXIT_STOPPED), console.read_text()[-3000:]
    log = (tmp_path / "runs" / "tiny" / RUN_LOG_FILE).read_text()
    stopped = re.search(r"lnstrain: stopped to be resumed after step (\d+) of 200 \(received SIGUSR1\); checkpoint "
                        r"(\S+); to continue, rerun: (.*)", log)
    assert stopped, log[-3000:]
    assert (Path(stopped.group(2)) / COMPLETE_MARKER).is_file()
    assert "Traceback" not in log
