"""One trainer per run directory (lnstrain/training/run_lock.py): a second trainer stops with exit 2
before writing anything, on every rank, naming the holder; the holder's death releases the lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.run_files import RUN_CONFIG_FILE, RUN_LOCK_FILE
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.outcome import EXIT_BAD_CONFIG
from lnstrain.training.run_lock import DirectoryLock, hold_run_directories, lock_directories, probe
from tests.training.test_launch import REPO, launcher_command, launcher_env

HOLDER = """
import sys, time
from lnstrain.training.run_lock import DirectoryLock
assert DirectoryLock(sys.argv[1]).acquire() is None
print("held", flush=True)
time.sleep(600)
"""


def hold_in_another_process(directory: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "SLURM_JOB_ID": "8812"})
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_lock_names_the_holder_and_the_holders_death_releases_it(tmp_path):
    holder = hold_in_another_process(tmp_path)
    try:
        message = DirectoryLock(tmp_path).acquire()
        assert message is not None and f"PID {holder.pid} on {socket.gethostname()}" in message, message
        assert "SLURM job 8812" in message and "in use by another trainer" in message
        assert probe(tmp_path) == message
        assert probe(tmp_path) == message  # probes take no lock of their own
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel releases the lock
        holder.wait(timeout=30)
    assert probe(tmp_path) is None
    lock = DirectoryLock(tmp_path)
    assert lock.acquire() is None
    assert json.loads((tmp_path / RUN_LOCK_FILE).read_text())["pid"] == os.getpid()
    assert DirectoryLock(tmp_path).acquire() is not None  # another open file in this process: excluded too
    lock.release()
    assert DirectoryLock(tmp_path).acquire() is None


def test_the_checkpoint_directory_is_locked_when_it_lies_outside_the_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    assert lock_directories(run_dir, run_dir / "checkpoints") == [run_dir]
    assert lock_directories(run_dir, tmp_path / "ckpt") == [run_dir, tmp_path / "ckpt"]
    holder = hold_in_another_process(tmp_path / "ckpt")
    try:
        with pytest.raises(RuntimeError, match="ckpt is in use by another trainer"):
            with hold_run_directories(lock_directories(run_dir, tmp_path / "ckpt"), rank=0, world_size=1):
                pytest.fail("entered")
        assert DirectoryLock(run_dir).acquire() is None  # the run directory's lock was given back
    finally:
        holder.kill()
        holder.wait(timeout=30)


def two_trainers(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.run_lock import RunDirectoryInUse
    from lnstrain.training.trainer import pretrain

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root) + ["train.steps=2"], world_size)
    refused = None
    try:
        pretrain(config)
    except RunDirectoryInUse as error:
        refused = str(error)
    return {"refused": refused, "written": sorted(p.name for p in config.run.dir.iterdir())}


@pytest.mark.multirank
def test_every_rank_of_a_second_trainer_stops_before_writing_anything(tiny_corpus, tmp_path):
    run_dir = tmp_path / "tiny"
    holder = hold_in_another_process(run_dir)  # the trainer that is already running, as its lock shows
    try:
        results = run_distributed(two_trainers, 2, tiny_corpus, tmp_path, timeout_s=180)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert results[0]["refused"] == results[1]["refused"] and f"PID {holder.pid}" in results[0]["refused"]
    assert results[0]["written"] == [RUN_LOCK_FILE]  # no config.yaml, no checkpoint, no TensorBoard file


def test_the_launcher_refuses_a_busy_run_directory_before_starting(tiny_corpus, tmp_path):
    holder = hold_in_another_process(tmp_path / "tiny")
    try:
        done = subprocess.run(launcher_command(tiny_run_overrides(tiny_corpus, tmp_path) + ["train.steps=2"]),
                              capture_output=True, text=True, env=launcher_env(), timeout=180)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert done.returncode == EXIT_BAD_CONFIG, done.stderr[-3000:]
    assert f"in use by another trainer (PID {holder.pid}" in done.stderr and "Traceback" not in done.stderr
    assert "nothing was started" in done.stderr
    assert not (tmp_path / "tiny" / RUN_CONFIG_FILE).exists()


def test_only_rank_0_looks_for_another_trainer_before_the_rendezvous(tiny_corpus, tmp_path):
    """Rank 0 of the same launch may already hold the lock while rank 1 is still checking: rank 1's
    pre-launch check must not take it for another trainer (the trainer's broadcast decides)."""
    from lnstrain.config.run_config import read_config_file
    from lnstrain.training.preflight import run_problems

    typed = read_config_file(str(TINY_RUN_CONFIG), tiny_run_overrides(tiny_corpus, tmp_path) + ["train.steps=2"])
    lock = DirectoryLock(tmp_path / "tiny")
    assert lock.acquire() is None
    try:
        assert run_problems(typed, 2, rank=1) == []
        [problem] = run_problems(typed, 2, rank=0)
        assert f"in use by another trainer (PID {os.getpid()}" in problem
    finally:
        lock.release()
    assert run_problems(typed, 2, rank=0) == []
