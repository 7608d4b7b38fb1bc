"""Where a run's checkpoints are: its ``global_step<N>`` directories and what ``latest`` names, found
without following a link and without trusting ``latest`` beyond a plain step name.

``latest`` holds the name of the newest complete step directory and nothing else; a ``latest`` that
holds anything else (a path, ``../``, bytes that are not text, a link) is damaged: it is ignored with
an error in the log, and the newest complete step directory is used, as when ``latest`` is missing.
A ``global_step<N>`` that is a link is never a checkpoint of this directory. All of this is pure
file-system reading: usable before any process group exists, by the launcher's pre-launch check and
by the tools.
"""

from __future__ import annotations

import logging
import os
import stat
import shutil
from pathlib import Path

from lnstrain.checkpoint.metadata import COMPLETE_MARKER, is_complete, step_of
from lnstrain.no_follow import LinkRefused, hard_link_detail, is_link, read_regular_file
from lnstrain.report_lines import capped, escaped
from lnstrain.run_files import (CHECKPOINTS_DIR, FINAL_METRICS_FILE, LATEST_FILE, RUN_CONFIG_FILE, RUN_LOCK_FILE,
                                TENSORBOARD_DIR)

logger = logging.getLogger(__name__)

_LATEST_MAX_BYTES = 128


def latest_name(checkpoint_dir: str | Path) -> tuple[Path | None, str | None]:
    """(the step directory ``<checkpoint_dir>/latest`` names, or None; why ``latest`` is unusable, or
    None). A missing ``latest`` is (None, None)."""
    path = Path(checkpoint_dir) / LATEST_FILE
    if not os.path.lexists(path):
        return None, None
    ignored = "ignored: the newest complete checkpoint is used instead"
    try:
        data = read_regular_file(path, _LATEST_MAX_BYTES)
    except LinkRefused as error:
        return None, f"{path} is {error.strerror}; {ignored}"
    except (OSError, ValueError) as error:
        return None, f"{path} cannot be read ({getattr(error, 'strerror', None) or error}); {ignored}"
    try:
        name = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, f"{path} holds bytes that are not a step name (damaged); {ignored}"
    if "/" in name or step_of(name) is None:
        return None, (f"{path} holds {name[:80]!r}, not the name of a global_step<N> directory beside it; it "
                      f"never names anything outside {checkpoint_dir}; {ignored}")
    return Path(checkpoint_dir) / name, None


def read_latest(checkpoint_dir: str | Path) -> Path | None:
    """The step directory ``latest`` names, or None when there is none or it is damaged."""
    return latest_name(checkpoint_dir)[0]


def step_dir_entries(checkpoint_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """(``global_step<N>`` directories, oldest first; ``global_step<N>`` entries that are links)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():  # the directory itself may be a link: the operator's choice
        return [], []
    directories, links = [], []
    with os.scandir(checkpoint_dir) as entries:
        for entry in entries:
            if step_of(entry.name) is None:
                continue
            if entry.is_symlink():
                links.append(Path(entry.path))
            elif entry.is_dir(follow_symlinks=False):
                directories.append(Path(entry.path))
    return sorted(directories, key=step_of), sorted(links, key=step_of)


def complete_step_dirs(checkpoint_dir: str | Path) -> list[Path]:
    """Complete ``global_step<N>`` directories under ``checkpoint_dir`` (never links), oldest first."""
    return [step_dir for step_dir in step_dir_entries(checkpoint_dir)[0] if is_complete(step_dir)]


def newest_checkpoint(checkpoint_dir: str | Path, log: bool = True) -> Path | None:
    """Where ``checkpoint_dir`` resumes from before verification: the step ``latest`` names when
    complete, else the newest complete step directory; incomplete (interrupted) step directories,
    links and a damaged ``latest`` are never followed. ``log``: say so in the log."""
    named, problem = latest_name(checkpoint_dir)
    if problem and log:
        logger.error("%s", problem)
    if named is not None and is_complete(named):
        return named
    complete = complete_step_dirs(checkpoint_dir)
    if named is not None and log:
        logger.warning("%s/latest names %s, which is not a complete checkpoint; using %s instead",
                       checkpoint_dir, named.name, complete[-1].name if complete else "none (starting fresh)")
    return complete[-1] if complete else None


def resolve_resume(resume: str, checkpoint_dir: str | Path, log: bool = True) -> tuple[Path | None, list[str]]:
    """(step directory to resume from or None, problems) for ``checkpoint.resume``, before its files
    are verified (``verifier.choose_checkpoint`` then falls back from it).

    ``auto``: this run's newest checkpoint if any; ``none``: start fresh, refusing a checkpoint
    directory that already holds checkpoints; otherwise a checkpoint directory or one step directory.
    ``log``: log a damaged ``latest`` (the pre-launch check leaves that to the trainer).
    """
    if resume == "auto":
        return newest_checkpoint(checkpoint_dir, log), []
    if resume == "none":
        existing = newest_checkpoint(checkpoint_dir, log)
        if existing is not None:
            return None, [f"checkpoint.resume is 'none' but {checkpoint_dir} already holds checkpoints "
                          f"(newest: {existing.name}); use checkpoint.resume: auto to continue that run, "
                          "or choose another run.name or checkpoint.dir"]
        return None, []
    path = Path(resume)
    if not os.path.lexists(path):
        return None, [f"checkpoint.resume: {path} does not exist (give a checkpoint directory, a "
                      "global_step<N> directory, 'auto' or 'none')"]
    if step_of(path) is not None:
        if is_link(path):
            return None, [f"checkpoint.resume: {path} is a symbolic link, which lnstrain does not follow; give the "
                          f"directory it points to ({os.path.realpath(path)})"]
        if not is_complete(path):
            return None, [f"checkpoint.resume: {path} is not a complete checkpoint (no {COMPLETE_MARKER}: "
                          "its save was interrupted); pick an older global_step<N> or the checkpoint directory"]
        return path, []
    found = newest_checkpoint(path, log)
    if found is None:
        return None, [f"checkpoint.resume: {path} holds no complete global_step<N> checkpoint"]
    return found, []


def remove_interrupted_saves(checkpoint_dir: str | Path) -> list[Path]:
    """Remove every ``global_step<N>`` directory of ``checkpoint_dir`` without a completion marker (a
    save cut off by a second Ctrl-C, a kill or a crash: nothing ever reads it) and say so in the log;
    returns them. Only the trainer calls this, on rank 0, holding the run directory's lock, before it
    resumes: no save of this run can be in flight then. Links are never followed (``step_dir_entries``)."""
    removed = [step_dir for step_dir in step_dir_entries(checkpoint_dir)[0] if not is_complete(step_dir)]
    for step_dir in removed:
        shutil.rmtree(step_dir)
        logger.warning("removed %s: its save was cut off before it finished (no %s; a second Ctrl-C, a kill or a "
                       "crash during the save), so it never was a checkpoint", escaped(step_dir), COMPLETE_MARKER)
    return removed


def remove_links(checkpoint_dir: str | Path) -> None:
    """Remove every link directly in ``checkpoint_dir`` (the links themselves: what they point to is
    left alone). lnstrain never makes one there; a save would write through ``global_step<N>`` if one
    were left. The pre-launch check refuses them first (``link_problems``); this is for a trainer
    started without it."""
    with os.scandir(checkpoint_dir) as entries:
        links = [Path(entry.path) for entry in entries if entry.is_symlink()]
    for link in links:
        logger.error("removing %s, a symbolic link (to %s) that lnstrain did not make, before saving", escaped(link),
                     escaped(os.readlink(link)))
        link.unlink()


def link_problems(run_dir: str | Path, checkpoint_dir: str | Path) -> list[str]:
    """Links where a trainer writes: among the run directory's own entries (``run_files``) and anywhere
    directly in the checkpoint directory, and a run lock with other names (a hard link: the lock file
    is written in place). lnstrain never makes one; writing through one would change a file outside
    the run (another run's checkpoint, or anything its owner can write)."""
    run_dir, checkpoint_dir = Path(run_dir), Path(checkpoint_dir)
    found = [run_dir / name for name in (RUN_CONFIG_FILE, CHECKPOINTS_DIR, TENSORBOARD_DIR, FINAL_METRICS_FILE,
                                         RUN_LOCK_FILE) if is_link(run_dir / name)]
    if checkpoint_dir.is_dir():
        with os.scandir(checkpoint_dir) as entries:
            found += [Path(entry.path) for entry in entries if entry.is_symlink() and Path(entry.path) not in found]
    hint = " (a checkpoints/ directory kept elsewhere: set checkpoint.dir to that directory instead)"
    problems = [f"{escaped(path)} is a symbolic link (to {escaped(os.readlink(path))}); lnstrain never makes links in a "
                f"run or checkpoint directory and does not write through them: remove it"
                f"{hint if path.name == CHECKPOINTS_DIR else ''}" for path in sorted(found)]
    for directory in dict.fromkeys((run_dir, checkpoint_dir)):
        lock = directory / RUN_LOCK_FILE
        try:
            status = os.lstat(lock)
        except OSError:
            continue
        if stat.S_ISREG(status.st_mode) and status.st_nlink > 1:
            problems.append(f"{escaped(lock)} is {hard_link_detail(status.st_nlink)}; a trainer writes its record "
                            "into the lock file: remove it")
    return capped(problems, "links")
