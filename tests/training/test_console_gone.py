"""A stop ends in a saved checkpoint and exit 75 whatever happened to the console: ``| tee`` killed by the
Ctrl-C (a real pipe whose reader died: EPIPE), stdout and stderr on a full disk (``/dev/full``: ENOSPC).
The stop and resume lines are in the run's own log, ``<run dir>/lnstrain.log``, either way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lnstrain.checkpoint.metadata import COMPLETE_MARKER
from lnstrain.run_files import RUN_LOG_FILE
from lnstrain.testing.tiny_corpus import tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED
from tests.training.test_launch import launcher_command, launcher_env

LONG = ["train.steps=1000", "checkpoint.interval_steps=0", "train.eval_interval=0", "logging.interval=1"]


def wait_for(path: Path, text: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until ``path`` holds ``text`` (the trainer is training), or fail with what it holds."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up and process.poll() is None:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    pytest.fail(f"{text!r} never reached {path}: {path.read_text(errors='replace')[-3000:] if path.is_file() else ''}")


def check_the_stop(run_dir: Path, signal_name: str, lost: str) -> str:
    log = (run_dir / RUN_LOG_FILE).read_text()
    stopped = re.search(rf"lnstrain: stopped to be resumed after step (\d+) of 1000 \(received {signal_name}\); "
                        r"checkpoint (\S+); to continue, rerun: (.*)", log)
    assert stopped, log[-3000:]
    assert (Path(stopped.group(2)) / COMPLETE_MARKER).is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"global_step{stopped.group(1)}"
    assert f"lnstrain: the console went away during this launch ({lost})" in log
    assert "Traceback" not in log and "Logging error" not in log
    return log


@pytest.mark.slow
def test_ctrl_c_through_a_tee_that_dies_with_it_still_saves_exits_75_and_logs_the_stop(tiny_corpus, tmp_path):
    """``python launch/pretrain.py ... 2>&1 | tee console.txt``, then Ctrl-C: tee dies of it, the trainer saves."""
    read, write = os.pipe()
    trainer = subprocess.Popen(launcher_command(tiny_run_overrides(tiny_corpus, tmp_path) + LONG), stdout=write,
                               stderr=write, env=launcher_env())
    with open(tmp_path / "console.txt", "wb") as console:
        tee = subprocess.Popen(["tee"], stdin=read, stdout=console)
    os.close(read), os.close(write)
    try:
        wait_for(tmp_path / "console.txt", "step 2/1000 |", trainer)
        tee.send_signal(signal.SIGINT)  # the Ctrl-C reaches tee first ...
        assert tee.wait(timeout=60) == -signal.SIGINT  # ... and the pipe has no reader any more
        trainer.send_signal(signal.SIGINT)  # ... then the trainer, which must save and say so
        assert trainer.wait(timeout=180) == EXIT_STOPPED
    finally:
        for process in (trainer, tee):
            if process.poll() is None:
                process.kill()
    check_the_stop(tmp_path / "tiny", "SIGINT", "Broken pipe")
    assert "step 2/1000 |" in (tmp_path / "console.txt").read_text()  # what tee got before it died


@pytest.mark.slow
def test_sigterm_with_stdout_and_stderr_on_a_full_disk_still_saves_exits_75_and_logs_the_stop(tiny_corpus,
                                                                                                tmp_path):
    with open("/dev/full", "w") as full:
        trainer = subprocess.Popen(launcher_command(tiny_run_overrides(tiny_corpus, tmp_path) + LONG), stdout=full,
                                   stderr=full, env=launcher_env())
    try:
        wait_for(tmp_path / "tiny" / RUN_LOG_FILE, "step 2/1000 |", trainer)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=180) == EXIT_STOPPED
    finally:
        if trainer.poll() is None:
            trainer.kill()
    log = check_the_stop(tmp_path / "tiny", "SIGTERM", "No space left on device")
    assert log.count("=== ") == 1 and "launch/pretrain.py --config" in log.split("\n", 1)[0]  # one launch, named


@pytest.mark.parametrize("plant", ["hard link", "symbolic link"])
def test_a_link_planted_at_the_run_log_is_refused_and_its_target_untouched(tmp_path, plant, capfd):
    """The run log is appended through ``no_follow.open_for_appending``: a link at its name would send
    the trainer's lines into a file outside the run."""
    import logging

    from lnstrain.training.run_log import RunLog

    victim = tmp_path / "outside.txt"
    victim.write_text("keep me\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (os.link if plant == "hard link" else os.symlink)(victim, run_dir / RUN_LOG_FILE)
    run_log = RunLog()
    run_log.open(run_dir, 0, "python launch/pretrain.py")
    try:
        logging.getLogger("lnstrain.test").warning("a line that must not reach the victim")
    finally:
        run_log.close()
    assert run_log.path is None
    assert victim.read_text() == "keep me\n"
    assert f"cannot open {run_dir / RUN_LOG_FILE}" in capfd.readouterr().err
