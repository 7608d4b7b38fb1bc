#!/usr/bin/env python
"""Run a training command so that a scheduler's warning signal makes every rank save and exit 0.

    python launch/slurm/preemptible.py -- deepspeed --num_gpus 8 launch/pretrain.py --config run.yaml
    python launch/slurm/preemptible.py -- srun ... python launch/pretrain.py --config run.yaml

Why: the DeepSpeed launcher forwards SIGTERM to its ranks but kills them 30 s later and exits 1,
and SIGUSR1 (not handled by it) kills the launcher and orphans the ranks. This wrapper starts the
command in its own process group with SIGUSR1 ignored (an ignored signal stays ignored across exec,
so the launcher processes ignore it; the ranks install their own handler). When the wrapper gets
SIGTERM, SIGUSR1 or SIGINT, it sends SIGUSR1 to the whole group: the ranks finish the current step,
save a checkpoint and exit 0, the launcher sees clean exits and exits 0, and so does this wrapper.
Its exit status is the command's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the launch command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the launch command after --")

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited by the command (and kept by the launchers)
    child = subprocess.Popen(command, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        print(f"preemptible: got {signal.Signals(signum).name}; asking every rank to save and stop (SIGUSR1)",
              file=sys.stderr, flush=True)
        try:
            os.killpg(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    returncode = child.wait()
    if returncode < 0:
        print(f"preemptible: the command died of {signal.Signals(-returncode).name}", file=sys.stderr)
        return 128 - returncode
    return returncode


if __name__ == "__main__":
    sys.exit(main())
