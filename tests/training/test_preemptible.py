"""launch/slurm/preemptible.py in a faked SLURM batch job: the scheduler's USR1 to the batch shell
(``#SBATCH --signal=B:USR1@N``) reaches the rank, not the launcher, and the job exits 0.

The fake launcher behaves as DeepSpeed's does: it does not handle SIGUSR1 (its default action would
kill it and orphan the rank) and exits 1 when a rank fails. The fake rank saves-and-exits-0 on
SIGUSR1, like the trainer. (The real launcher and trainer: tests/training/test_crash_recovery.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FAKE_RANK = """
import signal, sys, time
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
print("rank ready", flush=True)
while not stop:
    time.sleep(0.05)
print("rank saved and stopped", flush=True)
"""

FAKE_LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", {rank!r}])
while rank.poll() is None:
    time.sleep(0.05)
print(f"launcher: rank exited {{rank.returncode}}", flush=True)
sys.exit(0 if rank.returncode == 0 else 1)
"""

BATCH = """#!/bin/bash
#SBATCH --signal=B:USR1@180
set -euo pipefail
exec {python} {wrapper} -- {python} {launcher}
"""


def test_usr1_to_the_batch_shell_stops_the_rank_and_the_job_exits_zero(tmp_path):
    launcher = tmp_path / "fake_launcher.py"
    launcher.write_text(FAKE_LAUNCHER.format(rank=FAKE_RANK))
    batch = tmp_path / "job.sbatch"
    batch.write_text(BATCH.format(python=sys.executable, wrapper=REPO / "launch" / "slurm" / "preemptible.py",
                                  launcher=launcher))
    job = subprocess.Popen(["bash", str(batch)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert job.stdout.readline().strip() == "rank ready"
        time.sleep(0.2)
        os.kill(job.pid, signal.SIGUSR1)  # what SLURM does with B:USR1 (the shell exec'd the wrapper)
        output = job.communicate(timeout=30)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output
    assert "rank saved and stopped" in output and "launcher: rank exited 0" in output, output
    assert "got SIGUSR1; asking every rank to save and stop" in output, output


def test_a_second_ctrl_c_to_the_wrapper_stops_the_whole_command_at_once():
    """The first Ctrl-C asks the ranks to save (SIGUSR1, ignored by this stand-in that never saves); the
    second kills the command's process group and exits 130 with one line."""
    stuck = "import os, time; print(os.getpid(), flush=True); time.sleep(300)"
    wrapper = subprocess.Popen([sys.executable, str(REPO / "launch" / "slurm" / "preemptible.py"), "--",
                                sys.executable, "-c", stuck], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=os.environ | {"LNSTRAIN_RESUME_COMMAND": "bash launch/train.sh"})
    try:
        command_pid = int(wrapper.stdout.readline())
        wrapper.send_signal(signal.SIGINT)
        assert "got SIGINT; asking every rank to save and stop" in wrapper.stderr.readline()
        wrapper.send_signal(signal.SIGINT)
        assert wrapper.wait(timeout=30) == 130
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
    assert wrapper.stderr.read().strip() == ("preemptible: second Ctrl-C: stopped at once; the newest complete "
                                             "checkpoint is kept, and bash launch/train.sh resumes from it")
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{command_pid}") and time.monotonic() < deadline:  # killed, then reaped by init
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{command_pid}")


DUMPING_RANK = """
import faulthandler, signal, sys, time
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
faulthandler.register(signal.SIGUSR2, file=sys.stdout, all_threads=True)  # as lnstrain's stack dumps do
print("rank ready", flush=True)
def a_rank_at_work():
    while not stop:
        time.sleep(0.05)
a_rank_at_work()
print("rank saved and stopped", flush=True)
"""


def test_usr2_to_the_wrapper_makes_the_rank_write_its_stacks_and_the_launcher_survives(tmp_path):
    """The fake launcher does not handle SIGUSR2 (its default action would kill it): it inherits the
    wrapper's SIG_IGN, and the rank, which registers its own handler, writes its stack and goes on."""
    launcher = tmp_path / "fake_launcher.py"
    launcher.write_text(FAKE_LAUNCHER.format(rank=DUMPING_RANK))
    job = subprocess.Popen([sys.executable, str(REPO / "launch" / "slurm" / "preemptible.py"), "--", sys.executable,
                            str(launcher)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert job.stdout.readline().strip() == "rank ready"
        time.sleep(0.2)
        os.kill(job.pid, signal.SIGUSR2)  # what scancel --signal=USR2 does to the job step's task
        time.sleep(0.5)
        os.kill(job.pid, signal.SIGUSR1)  # then save and stop: the launcher must still be there
        output = job.communicate(timeout=30)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert "every rank writes its stacks" in output
    assert "most recent call first" in output and "a_rank_at_work" in output, output
    assert "rank saved and stopped" in output and "launcher: rank exited 0" in output, output
    assert job.returncode == 0, output
