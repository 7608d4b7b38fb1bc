"""A checkpoint that cannot be written, explained: the directory, the cause, the file system's free
space and what to do, instead of torch's ``basic_ios::clear: iostream error`` or ``unexpected pos``.

A failed save never touches the previous checkpoint (``latest`` moves only after every rank wrote
everything), so the message can say what a rerun resumes from.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

# What torch's C++ writer says when a write fails (it drops the errno): the ostream's exception, and
# PyTorchStreamWriter's checks of how much it wrote.
TORCH_WRITE_FAILURES = ("basic_ios::clear", "iostream error", "PytorchStreamWriter failed", "file write failed",
                        "unexpected pos")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
NEARLY_FULL = 0.01
"""A file system with less than this fraction free is called full when torch's message hides the errno."""


class CheckpointWriteError(OSError):
    """A checkpoint save failed to write (no space, no permission, another I/O error); the message says
    where, why and what to do. The previous checkpoint is untouched. ``agreed``: every rank raised this
    same message (``save_agreement``), so one rank printing it is enough."""

    def __init__(self, message: str, agreed: bool = False) -> None:
        super().__init__(message)
        self.agreed = agreed


def is_write_failure(error: BaseException) -> bool:
    """An OSError, or torch's RuntimeError for a write that failed (not, e.g., a collective's error)."""
    if isinstance(error, OSError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in TORCH_WRITE_FAILURES)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def free_space(path: Path) -> tuple[int, int] | None:
    """(free bytes, total bytes) of the file system holding ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                usage = shutil.disk_usage(candidate)
            except OSError:
                return None
            return usage.free, usage.total
    return None


def describe_write_failure(error: BaseException, step_dir: Path, previous: Path | None) -> str:
    """One paragraph: which checkpoint failed, where, why, the free space, and what a rerun does."""
    code = error.errno if isinstance(error, OSError) else None
    space = free_space(step_dir)
    nearly_full = space is not None and space[0] < NEARLY_FULL * space[1]
    where = f" writing {error.filename}" if isinstance(error, OSError) and error.filename else ""
    if code:
        cause = os.strerror(code)
    else:  # torch's writer: its own words, the errno lost
        cause = f"a write failed (torch: {(str(error).strip() or type(error).__name__).splitlines()[0]})"
    lines = [f"cannot save checkpoint {step_dir}: {cause}{where}."]
    if space is not None:
        lines.append(f"The file system holding {step_dir.parent} has {human_bytes(space[0])} free of "
                     f"{human_bytes(space[1])}.")
    if code in NO_SPACE or (code is None and nearly_full):
        lines.append("It is full: free space there (checkpoint.keep_last deletes old checkpoints after each save) "
                     "or point checkpoint.dir at a larger file system.")
    elif code in NO_PERMISSION:
        lines.append(f"Make {step_dir.parent} writable for user id {os.getuid()}, or point checkpoint.dir at a "
                     "directory it can write.")
    if previous is not None and previous.name == step_dir.name:  # failed after publishing it (retention)
        lines.append(f"{step_dir.name} itself is complete and a rerun of the same command resumes from it.")
    else:
        lines.append(f"The previous checkpoint {previous} is untouched: rerun the same command to resume from it"
                     if previous is not None else "There is no earlier checkpoint of this run")
        lines[-1] += f" ({step_dir.name} is incomplete and is never resumed from; deleting it frees its space)."
    return " ".join(lines)
