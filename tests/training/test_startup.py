"""A first run as a newcomer makes it: no C++ compiler needed, nothing compiled, a clean console, and a
busy rendezvous port named in one line (launch/pretrain.py in subprocesses)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.testing.distributed import distributed_env, free_port
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.training.test_launch import LAUNCHER, REPO, launcher_command, launcher_env

SHORT_RUN = ["train.steps=2", "train.eval_interval=0", "checkpoint.interval_steps=0"]
DEEPSPEED_CHATTER = ("Setting accelerator to CPU", "compilers.C.base", "-laio", "built successfully",
                     "torch_extensions", "is deprecated")


def without_compiler(tmp_path: Path) -> dict[str, str]:
    """No usable C/C++ compiler and an empty extensions cache: a compile attempt fails loudly."""
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {k: v for k, v in launcher_env().items() if k != "DS_ACCELERATOR"}
    return env | {"CXX": "/bin/false", "CC": "/bin/false", "TORCH_EXTENSIONS_DIR": str(extensions)}


def assert_nothing_built(tmp_path: Path, output: str) -> None:
    assert not any((tmp_path / "torch_extensions").iterdir()), "something was compiled"
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.slow
def test_plain_python_trains_without_a_compiler_and_prints_only_its_own_lines(tiny_corpus: TinyCorpus, tmp_path):
    command = launcher_command(tiny_run_overrides(tiny_corpus, tmp_path) + SHORT_RUN)
    done = subprocess.run(command, capture_output=True, text=True, env=without_compiler(tmp_path), timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "step 2/2 | loss" in done.stdout
    assert_nothing_built(tmp_path, output)
    lines = output.splitlines()
    assert "INFO lnstrain.launch: checking" in lines[0], lines[:3]  # the first line, before torch is imported
    assert all(" lnstrain." in line for line in lines), [line for line in lines if " lnstrain." not in line]
    assert not [line for line in lines if any(chatter in line for chatter in DEEPSPEED_CHATTER)]
    assert f"run directory {tmp_path / 'tiny'}" in done.stdout
    assert f"tensorboard --logdir {tmp_path / 'tiny' / 'tensorboard'}" not in done.stdout  # tensorboard: false


@pytest.mark.multirank
def test_deepspeed_launcher_trains_two_ranks_without_a_compiler(tiny_corpus: TinyCorpus, tmp_path):
    """--verbose shows DeepSpeed's informational messages; still nothing is compiled."""
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
               str(LAUNCHER), "--config", str(TINY_RUN_CONFIG), "--verbose"]
    for override in tiny_run_overrides(tiny_corpus, tmp_path) + SHORT_RUN:
        command += ["--set", override]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=without_compiler(tmp_path),
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "[rank 0] INFO lnstrain.training.metrics: step 2/2 | loss" in done.stdout
    assert "Initializing TorchBackend in DeepSpeed with backend gloo" in done.stdout  # --verbose
    assert_nothing_built(tmp_path, output)
    assert "built successfully" not in output


def test_busy_rendezvous_port_is_one_line_naming_master_port(tiny_corpus: TinyCorpus, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = launcher_env() | distributed_env(0, 1, port)
        done = subprocess.run(launcher_command(tiny_run_overrides(tiny_corpus, tmp_path) + SHORT_RUN),
                              capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    [message] = done.stderr.splitlines()
    assert f"rendezvous port 127.0.0.1:{port} (MASTER_PORT) is already in use" in message
    assert "--master_port" in message
