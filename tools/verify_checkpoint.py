#!/usr/bin/env python
"""Check that checkpoints hold exactly what their saves wrote, and that loading them runs no code.

    python tools/verify_checkpoint.py runs/lns                                  # every checkpoint of a run
    python tools/verify_checkpoint.py runs/lns/checkpoints/global_step4000      # one checkpoint

For each global_step<N> directory: every file its save recorded in lnstrain_complete exists with the
recorded size and SHA-256, and no .pt file's pickle names a class beyond the allow-list that resuming
admits (read without unpickling). One line per checkpoint:

    OK          every recorded file verifies
    CORRUPT     a file is missing, truncated or altered, or the marker is damaged (each one is named)
    UNSAFE      a file would run pickled code when loaded (resuming refuses it without --allow-pickle)
    UNVERIFIED  saved by an lnstrain that did not record checksums yet: only the pickles were checked
    INCOMPLETE  no lnstrain_complete: an interrupted save, which resuming never reads

and which checkpoint `checkpoint.resume: auto` would resume from.

Exit status: 0 when every complete checkpoint is OK or UNVERIFIED; 1 when one is CORRUPT or UNSAFE;
2 when PATH is not a checkpoint, a checkpoint directory or a run directory.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def step_dirs_of(path: Path) -> list[Path]:
    """The ``global_step<N>`` directories ``path`` names: itself, those in it, or those in its ``checkpoints/``."""
    from lnstrain.checkpoint.metadata import step_of
    from lnstrain.run_files import CHECKPOINTS_DIR

    if step_of(path) is not None:
        return [path]
    for directory in (path, path / CHECKPOINTS_DIR):
        if directory.is_dir():
            found = [p for p in directory.iterdir() if p.is_dir() and step_of(p) is not None]
            if found:
                return sorted(found, key=step_of)
    return []


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def describe(step_dir: Path) -> tuple[str, list[str]]:
    """(verdict word, detail lines) for one step directory."""
    from lnstrain.checkpoint.integrity import check_step_dir
    from lnstrain.checkpoint.metadata import COMPLETE_MARKER, is_complete

    if not is_complete(step_dir):
        return "INCOMPLETE", [f"no {COMPLETE_MARKER} (its save was interrupted): resuming never reads it"]
    verdict = check_step_dir(step_dir)
    if verdict.corrupt or verdict.altered:
        return "CORRUPT", verdict.corrupt + verdict.altered + verdict.unsafe
    if verdict.unsafe:
        return "UNSAFE", verdict.unsafe + ["resuming refuses it unless the checkpoint is trusted (--allow-pickle)"]
    if not verdict.recorded:
        return "UNVERIFIED", [f"{verdict.files} files; saved before lnstrain recorded sizes and checksums"]
    return "OK", [f"{verdict.files} files, {_size(verdict.bytes)}, sizes and SHA-256 match"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("path", help="a run directory, its checkpoints/ directory or one global_step<N> directory")
    args = parser.parse_args(argv)
    path = Path(args.path)
    step_dirs = step_dirs_of(path)
    if not step_dirs:
        print(f"verify_checkpoint: {path} is not a global_step<N> directory and holds no global_step<N> "
              "directories (nor does its checkpoints/)", file=sys.stderr)
        return 2
    from lnstrain.parallel.deepspeed_comm import name_cpu_accelerator_if_no_cuda

    name_cpu_accelerator_if_no_cuda()  # DeepSpeed's record classes are imported to check pickles
    words: dict[Path, str] = {}
    width = max(len(p.name) for p in step_dirs)
    for step_dir in step_dirs:
        words[step_dir], details = describe(step_dir)
        print(f"{step_dir.name:<{width}}  {words[step_dir]:<10}  {details[0]}")
        for line in details[1:]:
            print(f"{'':<{width}}  {'':<10}  {line}")
    if len(step_dirs) > 1 or step_dirs[0] != path:
        print(resume_line(step_dirs[0].parent, words))
    return 1 if any(word in ("CORRUPT", "UNSAFE") for word in words.values()) else 0


def resume_line(directory: Path, words: dict[Path, str]) -> str:
    """What ``checkpoint.resume: auto`` does with these verdicts (``CheckpointManager.verified_checkpoint``)."""
    from lnstrain.checkpoint.manager import complete_step_dirs, newest_checkpoint, read_latest
    from lnstrain.checkpoint.metadata import step_of

    latest = read_latest(directory)
    named = f"latest names {latest.name}" if latest else "no latest"
    newest = newest_checkpoint(directory)
    if newest is None:
        return f"{named}; checkpoint.resume: auto starts at step 0"
    older = [p for p in reversed(complete_step_dirs(directory)) if step_of(p) < step_of(newest)]
    for candidate in [newest, *older]:
        if words.get(candidate) == "UNSAFE":
            return f"{named}; checkpoint.resume: auto refuses {candidate.name} unless --allow-pickle"
        if words.get(candidate) in ("OK", "UNVERIFIED"):
            return f"{named}; checkpoint.resume: auto resumes from {candidate.name}"
    return f"{named}; checkpoint.resume: auto stops: no checkpoint verifies"


if __name__ == "__main__":
    sys.exit(main())
