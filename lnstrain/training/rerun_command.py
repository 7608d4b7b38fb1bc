"""The command that continues a stopped run, as the user would type it again.

A run stopped to be resumed (exit 75) or interrupted says what to rerun. The rank knows only its own
``argv``; the command the user typed may be a script (``launch/train.sh`` sets
``LNSTRAIN_RESUME_COMMAND``), a launcher above the rank (``deepspeed``, ``torchrun``, possibly under
``launch/slurm/preemptible.py``: found among the rank's ancestors in ``/proc``), or the rank's own
``python launch/pretrain.py ...``. ``--stop-at-step N`` is left out: the same command with it would
stop again at once.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping, Sequence

RESUME_COMMAND_ENV = "LNSTRAIN_RESUME_COMMAND"
LAUNCHERS = ("deepspeed", "torchrun", "preemptible.py")
"""Programs above a rank whose command line is the one to rerun (the outermost one found)."""
ANCESTORS_SEARCHED = 6
ONE_SHOT_OPTIONS = ("--stop-at-step",)
LAUNCHER_GIVEN_OPTIONS = ("--local_rank", "--local-rank")


def _without(args: Sequence[str], options: Sequence[str]) -> list[str]:
    """``args`` less each of ``options`` and its value (``--opt V`` or ``--opt=V``)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in options)):
            kept.append(arg)
    return kept


def proc_command_line(pid: int) -> tuple[list[str], int] | None:
    """(argv, parent pid) of a process from Linux's ``/proc``, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = [part.decode(errors="replace") for part in file.read().split(b"\0") if part]
        with open(f"/proc/{pid}/stat", "rb") as file:
            parent = int(file.read().rsplit(b")", 1)[1].split()[1])  # the name in () may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    return argv, parent


def launcher_command(read: Callable[[int], tuple[list[str], int] | None] = proc_command_line,
                     pid: int | None = None) -> list[str] | None:
    """The outermost launcher command line among this process's nearest ancestors, from the launcher's
    name on (``deepspeed --num_gpus 2 launch/pretrain.py ...``), or None."""
    found = None
    entry = read(os.getpid() if pid is None else pid)
    for _ in range(ANCESTORS_SEARCHED):
        if entry is None or entry[1] <= 1:
            break
        entry = read(entry[1])
        if entry is None:
            break
        argv = entry[0]
        for position, arg in enumerate(argv[:2]):  # the program, or the script a Python runs
            name = os.path.basename(arg)
            if name in LAUNCHERS:
                found = [f"python {arg}" if name.endswith(".py") else name, *argv[position + 1:]]
                break
    return found


def resume_command(argv: Sequence[str], environ: Mapping[str, str] = os.environ,
                   launcher: Callable[[], list[str] | None] = launcher_command) -> str:
    """What to rerun to continue this run; ``argv`` is the rank's ``sys.argv``."""
    if environ.get(RESUME_COMMAND_ENV):
        return environ[RESUME_COMMAND_ENV]
    if "LOCAL_RANK" in environ or int(environ.get("WORLD_SIZE", "1")) > 1:
        found = launcher()
        if not found:
            return "the same launch command"
        program, *args = found
        return " ".join([program, shlex.join(_without(args, ONE_SHOT_OPTIONS))]).strip()
    return shlex.join(["python", *_without(_without(argv, LAUNCHER_GIVEN_OPTIONS), ONE_SHOT_OPTIONS)])
