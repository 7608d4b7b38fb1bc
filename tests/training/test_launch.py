"""launch/pretrain.py as users run it: pre-flight errors and a clean stop on SIGTERM (subprocesses)."""

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

from lnstrain.checkpoint.metadata import COMPLETE_MARKER, step_of
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launch" / "pretrain.py"


def launcher_command(overrides: list[str]) -> list[str]:
    command = [sys.executable, str(LAUNCHER), "--config", str(TINY_RUN_CONFIG)]
    for override in overrides:
        command += ["--set", override]
    return command


def launcher_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return env | {"PYTHONUNBUFFERED": "1"}


def test_preflight_reports_every_problem_before_training(tiny_corpus, tmp_path):
    a_file = tmp_path / "not_a_directory"
    a_file.write_text("")
    missing_prefix = tmp_path / "missing" / "tokens"
    overrides = tiny_run_overrides(tiny_corpus, a_file / "runs") + [
        f"data.sources=[{{prefix: '{missing_prefix}'}}]", "model.vocab_size=64"]
    done = subprocess.run(launcher_command(overrides), capture_output=True, text=True, env=launcher_env(),
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "3 problem(s)" in done.stderr, done.stderr
    assert f"data.sources[0].prefix: missing {missing_prefix}.bin" in done.stderr
    assert (f"data.tokenizer {tiny_corpus.tokenizer} has 200 pieces but model.vocab_size is 64: the model has no "
            "embedding for ids 64..199; set model.vocab_size to 200") in done.stderr
    assert f"run.output_dir: cannot write to {a_file / 'runs' / 'tiny'}" in done.stderr
    assert "training steps" not in done.stdout  # nothing started


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_to_be_resumed(tiny_corpus, tmp_path):
    overrides = tiny_run_overrides(tiny_corpus, tmp_path) + [
        "train.steps=1000", "checkpoint.interval_steps=0", "train.eval_interval=0"]
    process = subprocess.Popen(launcher_command(overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=launcher_env())
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            if "step 3/1000" in line:
                process.send_signal(signal.SIGTERM)
                break
        output += process.stdout.readlines()
        assert process.wait(timeout=120) == EXIT_STOPPED, "".join(output)
    finally:
        if process.poll() is None:
            process.kill()
    text = "".join(output)
    assert "stopping after step" in text and "received SIGTERM" in text, text
    stopped = re.search(r"lnstrain: stopped to be resumed after step (\d+) of 1000 \(received SIGTERM\); checkpoint "
                        r"(\S+); to continue, rerun: (.*)", text)
    assert stopped, text
    assert stopped.group(3) == shlex.join(["python", *launcher_command(overrides)[1:]])  # the command, as run
    checkpoints = tmp_path / "tiny" / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    assert 3 <= step_of(latest) < 1000
    assert (checkpoints / latest / COMPLETE_MARKER).is_file()
    assert (tmp_path / "tiny" / "config.yaml").is_file()


@pytest.mark.slow
def test_dry_run_of_a_multi_gpu_config_without_a_launcher():
    """A plain `python ... --dry-run` estimates one data-parallel replica; --world-size picks another size."""
    command = [sys.executable, str(LAUNCHER), "--config", str(REPO / "configs" / "7b_lns.yaml"), "--dry-run"]
    default = subprocess.run(command, capture_output=True, text=True, env=launcher_env(), timeout=120)
    assert default.returncode == 0, default.stderr
    assert "on 4 rank(s)" in default.stdout  # tp 2 × pp 2
    sixteen = subprocess.run(command + ["--world-size", "16"], capture_output=True, text=True, env=launcher_env(),
                             timeout=120)
    assert sixteen.returncode == 0 and "on 16 rank(s)" in sixteen.stdout and "data 4" in sixteen.stdout
    bad = subprocess.run(command + ["--world-size", "6"], capture_output=True, text=True, env=launcher_env(),
                         timeout=120)
    assert bad.returncode == 2 and "world size 6 is not divisible" in bad.stderr
