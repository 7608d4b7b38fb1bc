#!/usr/bin/env python
"""Run a training command so that a scheduler's warning signal makes every rank save and stop.

    python launch/slurm/preemptible.py -- deepspeed --num_gpus 8 launch/pretrain.py --config run.yaml
    python launch/slurm/preemptible.py -- srun ... python launch/pretrain.py --config run.yaml

Why: the DeepSpeed launcher forwards SIGTERM to its ranks but kills them 30 s later and exits 1,
and SIGUSR1 (not handled by it) kills the launcher and orphans the ranks. This wrapper starts the
command in its own process group with SIGUSR1 ignored (an ignored signal stays ignored across exec,
so the launcher processes ignore it; the ranks install their own handler). When the wrapper gets
SIGTERM, SIGUSR1 or SIGINT, it sends SIGUSR1 to the whole group: the ranks finish the current step,
save a checkpoint and exit 75 (stopped to be resumed), the launcher passes that on, and so does this
wrapper. Its exit status is the command's. A second SIGINT (Ctrl-C pressed again) stops everything at
once: SIGKILL to the group, exit 130; the last complete checkpoint stays (saves survive any kill).

SIGUSR2 is relayed as it is: the ranks write every thread's Python stack to their stderr and go on
(lnstrain/training/stack_dumps.py), while the launchers ignore it, as they ignore SIGUSR1; so
``scancel --signal=USR2 <job>`` or ``kill -USR2 <wrapper pid>`` shows where every rank is.

On Linux the wrapper also adopts orphaned descendants (PR_SET_CHILD_SUBREAPER) and waits for them:
when a job is cancelled or requeued, SIGTERM kills the ``deepspeed`` runner at once while the launcher
below it lingers; adopted, the launcher and its ranks stay in the job's process tree, where SLURM's
``proctrack/linuxproc`` finds them (by parent) to kill, instead of living on outside the job.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lnstrain.training.run_log import guard_console  # noqa: E402  (no torch: its messages survive a lost console)

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
RELAYED = signal.SIGUSR2  # every rank writes its stacks and goes on
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
ADOPTED_GRACE_S = 120  # how long adopted processes may outlive the command before they are killed


def adopt_orphans() -> bool:
    """Become the parent of descendants whose own parent dies (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_adopted(group: int) -> None:
    """Wait until no adopted descendant is left; SIGKILL the command's process group if they linger."""
    deadline = time.monotonic() + ADOPTED_GRACE_S
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        if time.monotonic() > deadline:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launch command, after --")
    args = parser.parse_args(argv)
    guard_console()  # a message to a console that went away (| tee killed by the Ctrl-C) must not stop the relay
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the launch command after --")

    for ignored in (signal.SIGUSR1, RELAYED):  # inherited by the command (and kept by the launchers)
        signal.signal(ignored, signal.SIG_IGN)
    adopting = adopt_orphans()
    child = subprocess.Popen(command, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        if signum == signal.SIGINT and signal.SIGINT in received:
            rerun = os.environ.get("LNSTRAIN_RESUME_COMMAND") or "the same command"
            print(f"preemptible: second Ctrl-C: stopped at once; the newest complete checkpoint is kept, and {rerun} "
                  "resumes from it", file=sys.stderr, flush=True)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os._exit(EXIT_INTERRUPTED)
        received.append(signum)
        again = " after its current step; Ctrl-C again stops at once" if signum == signal.SIGINT else ""
        print(f"preemptible: got {signal.Signals(signum).name}; asking every rank to save and stop (SIGUSR1){again}",
              file=sys.stderr, flush=True)
        try:
            os.killpg(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass

    def relay(signum: int, _frame) -> None:
        print(f"preemptible: got {signal.Signals(signum).name}; every rank writes its stacks to its stderr",
              file=sys.stderr, flush=True)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.signal(RELAYED, relay)
    returncode = child.wait()
    if adopting:
        reap_adopted(child.pid)
    if returncode < 0:
        print(f"preemptible: the command died of {signal.Signals(-returncode).name}", file=sys.stderr)
        return 128 - returncode
    return returncode


if __name__ == "__main__":
    sys.exit(main())
