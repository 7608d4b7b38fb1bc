#!/usr/bin/env python
"""Check that checkpoints hold exactly what their saves wrote, and that loading them runs no code.

    python tools/verify_checkpoint.py runs/lns                                  # every checkpoint of a run
    python tools/verify_checkpoint.py runs/lns/checkpoints/global_step4000      # one checkpoint
    python tools/verify_checkpoint.py runs/lns --key ~/.lnstrain/lns.key        # and their signatures

The same checks, with the same opt-ins, as a resume and every other tool (lnstrain/checkpoint/
verifier.py): the completion marker is intact, the directory holds exactly the files it records
(none missing, none added, no links), each with its recorded size and SHA-256, the metadata agrees
with the directory and its files, and no .pt file's pickle names a class beyond the allow-list (read
without unpickling). One line per checkpoint:

    OK          every check passes
    CORRUPT     a file is missing, added, truncated or altered, or the marker or metadata is damaged
    UNSAFE      a file would run pickled code when loaded, or its pickles cannot be scanned (used only
                with --allow-pickle)
    UNVERIFIED  saved by an lnstrain before checksums: only the pickles were checked (used only with
                --allow-unverified)
    INCOMPLETE  no lnstrain_complete: an interrupted save, which is never read
    LINK        a global_step<N> that is a symbolic link: never read

With --key (the run's checkpoint.signing_key_file) each line also says SIGNED (its marker was signed
with that key), UNSIGNED or FORGED (a signature that does not verify); a resume with that key uses
only SIGNED checkpoints (UNSIGNED too with --allow-unverified). The signature is checked first: a
FORGED checkpoint, or an UNSIGNED one without --allow-unverified, is UNTRUSTED and none of its files
is read. The last line says which checkpoint a
resume (checkpoint.resume: auto) with these opt-ins would use.

Exit status: 0 when every complete checkpoint would be used; 1 when some would not, but a resume
still has one to use; 2 when a resume would stop (nothing to use, or a file that would run code), or
PATH is not a checkpoint, a checkpoint directory or a run directory.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.errors import CheckpointError  # noqa: E402
from lnstrain.checkpoint.verifier import add_trust_arguments, trust_from_arguments  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402
from lnstrain.report_lines import escaped  # noqa: E402


def step_dirs_of(path: Path) -> tuple[Path | None, list[Path], list[Path]]:
    """(the checkpoint directory, its ``global_step<N>`` directories, those that are links) for
    ``path``: one step directory, a checkpoint directory or a run directory."""
    from lnstrain.checkpoint.locations import step_dir_entries
    from lnstrain.checkpoint.metadata import step_of
    from lnstrain.checkpoint.verifier import checkpoint_directory
    from lnstrain.no_follow import is_link

    if step_of(path) is not None and is_link(path):
        return None, [], [path]
    if step_of(path) is not None and path.is_dir():
        return None, [path], []
    directory = checkpoint_directory(path)
    return (directory, *step_dir_entries(directory))


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def describe(verdict, trust) -> tuple[str, list[str]]:
    """(verdict word, detail lines) of one complete step directory's ``verifier.Verdict``."""
    if not verdict.read:
        return "UNTRUSTED", ["its marker's signature does not vouch for it, so none of the files it lists was read"]
    if verdict.corrupt or verdict.altered:
        return "CORRUPT", verdict.corrupt + verdict.altered + verdict.unsafe
    if verdict.unsafe:
        return "UNSAFE", verdict.unsafe + ["used only with --allow-pickle (a checkpoint you trust)"]
    if not verdict.recorded:
        return "UNVERIFIED", [f"{verdict.files} files; saved before lnstrain recorded sizes and checksums"
                              + ("" if trust.allow_unverified else "; used only with --allow-unverified")]
    details = [f"{verdict.files} files, {_size(verdict.bytes)}, sizes and SHA-256 match"]
    if trust.key is None and verdict.signed:
        details[0] += "; signed (give --key to check the signature)"
    return "OK", details


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("path", help="a run directory, its checkpoints/ directory or one global_step<N> directory")
    add_trust_arguments(parser)
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        trust = trust_from_arguments(args, path)
    except CheckpointError as error:
        print(f"verify_checkpoint: {error}", file=sys.stderr)
        return 2
    directory, step_dirs, links = step_dirs_of(path)
    if not step_dirs and not links:
        print(f"verify_checkpoint: {path} is not a global_step<N> directory and holds no global_step<N> "
              "directories (nor does its checkpoints/)", file=sys.stderr)
        return 2
    from lnstrain.checkpoint.metadata import COMPLETE_MARKER, is_complete, step_of
    from lnstrain.checkpoint.verifier import check_step_dir
    from lnstrain.parallel.deepspeed_comm import name_cpu_accelerator_if_no_cuda

    name_cpu_accelerator_if_no_cuda()  # DeepSpeed's record classes are imported to check pickles
    verdicts = {}
    width = max(len(p.name) for p in step_dirs + links)
    for step_dir in sorted(step_dirs + links, key=step_of):
        signature = ""
        if step_dir in links:
            word, details = "LINK", [f"a symbolic link (to {escaped(os.readlink(step_dir))}): never read"]
        elif not is_complete(step_dir):
            word, details = "INCOMPLETE", [f"no {COMPLETE_MARKER} (its save was interrupted): never read"]
        else:
            verdicts[step_dir] = verdict = check_step_dir(step_dir, trust)
            word, details = describe(verdict, trust)
            if verdict.signature:
                signature = f"{verdict.signature.upper():<9} "
                if verdict.signature != "signed":
                    details.insert(1, verdict.signature_detail)
        print(f"{step_dir.name:<{width}}  {word:<10}  {signature}{details[0]}")
        for line in details[1:]:
            print(f"{'':<{width}}  {'':<10}  {line}")
    usable = [step_dir for step_dir, verdict in verdicts.items()
              if not verdict.skip_reasons(trust) and not verdict.refusal(trust)]
    resume, stops = resume_line(directory, path, verdicts, trust)
    print(resume)
    if stops:
        return 2
    return 0 if len(usable) == len(verdicts) else 1


def resume_line(directory: Path | None, path: Path, verdicts: dict, trust) -> tuple[str, bool]:
    """(what a resume with these opt-ins does, whether it stops), choosing as the resume does
    (``verifier.choose_checkpoint``) from the verdicts already found."""
    from lnstrain.checkpoint.locations import latest_name, newest_checkpoint
    from lnstrain.checkpoint.verifier import check_step_dir, choose_checkpoint

    def check(step_dir: Path):
        return verdicts.get(step_dir) or check_step_dir(step_dir, trust)

    if directory is None:  # one global_step<N>: used as it is, or not at all
        if path not in verdicts:
            return f"checkpoint.resume: {path.name} stops: not a complete checkpoint", True
        choice = choose_checkpoint(path, trust, False, check, log=False)
        named = f"checkpoint.resume: {path.name}"
    else:
        latest, problem = latest_name(directory)
        named = (f"latest names {latest.name}" if latest else
                 f"latest is damaged ({problem.split('; ')[0]})" if problem else "no latest")
        named += "; checkpoint.resume: auto"
        start = newest_checkpoint(directory)
        if start is None:
            return f"{named} starts at step 0", False
        choice = choose_checkpoint(start, trust, True, check, log=False)
    if choice.refusal:
        first_line = choice.refusal.splitlines()[0]
        return f"{named} stops: {first_line}", True
    if choice.step_dir is None:
        return f"{named} stops: no checkpoint verifies", True
    return f"{named} resumes from {choice.step_dir.name}", False


if __name__ == "__main__":
    sys.exit(main())
