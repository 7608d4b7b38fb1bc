"""The one verifier: whether a checkpoint holds what its save wrote, and which checkpoint to use.

Everything that reads an lnstrain checkpoint asks this module first, with the same rules and the same
opt-ins (``Trust``): the resume and a rollback (``CheckpointManager.verified_checkpoint``), the
pre-launch check, ``checkpoint.init_from``, and the tools (``verify_checkpoint``,
``consolidate_checkpoint``, ``convert_to_hf``, ``analyze_depth``). Nothing in a step directory is
parsed or loaded before the checks that cover it have passed:

1. the completion marker is the JSON lnstrain writes (``integrity.read_marker``); a damaged marker is
   CORRUPT, and only the exact time-only marker of an lnstrain before checksums reads as UNVERIFIED;
2. the directory holds exactly the files the marker records: none missing, none unlisted (DeepSpeed
   finds some files by pattern), no link, nothing but files and directories;
3. every file has its recorded size and SHA-256: the metadata and config always (before they are
   parsed), the others on resume and in the tools (``QUICK`` checks their sizes only);
4. the metadata parses, names this directory's step and a layout that fits the files;
5. no ``.pt`` file's pickle names a class beyond the allow-list (``FULL`` only);
6. with a signing key, the marker's signature verifies (``signing``).

Choosing (``choose_checkpoint``): a checkpoint that fails 1-4, a FORGED one, and (without
``allow_unverified``) an UNVERIFIED or, with a key, UNSIGNED one are skipped for the newest older
checkpoint that passes, each problem logged with the file it names; a file that fails 5 stops the
choice (unless ``allow_pickle``: the user trusts the checkpoint), and so does an RNG file holding
more than tensors (under any opt-in). docs/checkpoints.md, "Threat model", says what this catches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lnstrain.checkpoint.deepspeed_files import layout_problems
from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.integrity import FileRecord, MarkerError, file_record, read_marker
from lnstrain.checkpoint.locations import complete_step_dirs, newest_checkpoint
from lnstrain.checkpoint.metadata import (COMPLETE_MARKER, CONFIG_FILE, METADATA_FILE, RNG_DIR, is_complete,
                                          read_metadata, saved_config_data, step_of)
from lnstrain.checkpoint.safe_load import OPT_IN, unsafe_globals
from lnstrain.checkpoint.signing import KeyFileError, SigningKey, check_signature, read_signing_key
from lnstrain.no_follow import is_link
from lnstrain.run_files import CHECKPOINTS_DIR

logger = logging.getLogger(__name__)

QUICK, FULL = "quick", "full"
"""How deep ``check_step_dir`` looks: ``QUICK`` (the pre-launch check, on every rank) hashes only the
metadata and config and compares the other files' sizes; ``FULL`` hashes everything and scans the
pickles."""
UNVERIFIED_OPT_IN = "--allow-unverified (config: checkpoint.allow_unverified: true)"
_OWN_FILES = (METADATA_FILE, CONFIG_FILE)


@dataclass(frozen=True)
class Trust:
    """What a reader accepts beyond a checkpoint its marker proves, and the key it proves signatures with."""

    allow_pickle: bool = False
    """Load DeepSpeed files whose pickle names classes beyond the allow-list (``--allow-pickle``)."""
    allow_unverified: bool = False
    """Use a checkpoint whose files cannot be verified: saved before checksums, or, with a key,
    unsigned (``--allow-unverified``). A damaged or forged one is never used."""
    key: SigningKey | None = None
    """``checkpoint.signing_key_file`` / ``--key``: only checkpoints signed with it are used."""
    checksums: bool = True
    """``checkpoint.verify_checksums``: compare every file's SHA-256 (else sizes only, beyond lnstrain's own)."""

    @classmethod
    def from_config(cls, checkpoint: Any, protected: list[Path] = ()) -> "Trust":
        """The trust of a run's ``checkpoint`` section; ``protected``: its run and checkpoint
        directories, which must not hold the key. Raises ``CheckpointError`` for an unusable key."""
        key = None
        if checkpoint.signing_key_file:
            try:
                key = read_signing_key(checkpoint.signing_key_file, list(protected))
            except KeyFileError as error:
                raise CheckpointError(str(error)) from None
        return cls(checkpoint.allow_pickle, checkpoint.allow_unverified, key, checkpoint.verify_checksums)


@dataclass
class Verdict:
    """What checking (a share of) one checkpoint found; every line names a file."""

    step_dir: Path
    corrupt: list[str] = field(default_factory=list)
    """The marker damaged, a file missing, unlisted, truncated, altered or a link, the metadata wrong."""
    unsafe: list[str] = field(default_factory=list)
    """DeepSpeed's files whose pickle names classes beyond the allow-list."""
    altered: list[str] = field(default_factory=list)
    """lnstrain's own RNG files whose pickle names classes beyond tensors: never written by a save."""
    recorded: bool = True
    """False: the marker predates file records (UNVERIFIED)."""
    signed: bool = False
    """The marker carries a signature (checked only with a key)."""
    signature: str | None = None
    """With a key: ``signed``, ``unsigned`` or ``forged``."""
    signature_detail: str = ""
    files: int = 0
    bytes: int = 0

    @property
    def marker(self) -> Path:
        return self.step_dir / COMPLETE_MARKER

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.unsafe and not self.altered

    def merge(self, other: "Verdict") -> None:
        """Add another rank's share (lines every share found are kept once)."""
        for name in ("corrupt", "unsafe", "altered"):
            setattr(self, name, list(dict.fromkeys(getattr(self, name) + getattr(other, name))))
        self.files += other.files
        self.bytes += other.bytes
        self.recorded = self.recorded and other.recorded
        self.signed = self.signed or other.signed
        if self.signature is None:
            self.signature, self.signature_detail = other.signature, other.signature_detail

    def refusal(self, trust: Trust, purpose: str = "resume from") -> str | None:
        """Why nothing may be loaded from here, not even an older checkpoint instead: a file that
        would run code (without ``allow_pickle``), or an RNG file altered to do so."""
        if self.altered:
            return (f"cannot {purpose} {self.step_dir}: files were altered to hold more than tensors, so nothing "
                    "was loaded:\n  - " + "\n  - ".join(self.altered)
                    + f"\nDelete {self.step_dir} to use the checkpoint before it.")
        if self.unsafe and not trust.allow_pickle:
            return (f"cannot {purpose} {self.step_dir}: loading it could run code stored in it, so nothing was "
                    "loaded:\n  - " + "\n  - ".join(self.unsafe)
                    + f"\nIf you trust where this checkpoint came from, pass {OPT_IN}")
        return None

    def skip_reasons(self, trust: Trust) -> list[str]:
        """Why this checkpoint is not used (the newest older one that passes is); empty: use it."""
        reasons = list(self.corrupt)
        if not self.recorded and not trust.allow_unverified:
            reasons.append(f"{self.marker}: written by an lnstrain before checksums, so its files cannot be "
                           f"verified; to use it anyway pass {UNVERIFIED_OPT_IN}")
        if self.signature == "forged":
            reasons.append(f"{self.marker}: FORGED: {self.signature_detail}")
        elif self.signature == "unsigned" and not trust.allow_unverified:
            reasons.append(f"{self.marker}: UNSIGNED: {self.signature_detail}; with checkpoint.signing_key_file "
                           f"only checkpoints signed with that key are used (pass {UNVERIFIED_OPT_IN} to accept "
                           "an unsigned one)")
        return reasons


# --- checking one step directory -------------------------------------------------------------------
def _walk(step_dir: Path) -> tuple[list[str], list[str]]:
    """(relative names of the regular files under ``step_dir`` but its marker; a line for each entry
    that is a link or neither a file nor a directory). Links are never followed."""
    files, odd = [], []
    pending = [step_dir]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                path = Path(entry.path)
                name = path.relative_to(step_dir).as_posix()
                if entry.is_symlink():
                    odd.append(f"{path}: a symbolic link (to {os.readlink(path)}), which no save writes; it is "
                               "never followed")
                elif entry.is_dir(follow_symlinks=False):
                    pending.append(path)
                elif not entry.is_file(follow_symlinks=False):
                    odd.append(f"{path}: not a regular file, which no save writes")
                elif name != COMPLETE_MARKER:
                    files.append(name)
    return sorted(files), odd


def file_problem(step_dir: Path, name: str, record: FileRecord, checksum: bool = True) -> str | None:
    """Why ``step_dir/name`` is not what its save wrote (missing, other size, other bytes; the bytes
    only with ``checksum``), or None."""
    path = step_dir / name
    try:
        size = os.lstat(path).st_size
        if size != record.size:
            return f"{path}: {size} bytes, but its save wrote {record.size} (truncated or overwritten)"
        if not checksum:
            return None
        found = file_record(path, record.rank)
    except FileNotFoundError:
        return f"{path}: missing (its save wrote it)"
    except OSError as error:
        return f"{path}: cannot be read ({error.strerror or error})"
    if found.sha256 != record.sha256:
        return (f"{path}: its bytes differ from what its save wrote (sha256 {found.sha256[:16]}…, "
                f"recorded {record.sha256[:16]}…)")
    return None


def _content_problems(step_dir: Path, names: list[str]) -> list[str]:
    """The metadata and config parse, the metadata names this directory's step, and its layout fits
    the files ``names``. Called only once both files verified (or for an UNVERIFIED checkpoint)."""
    metadata_path, config_path = step_dir / METADATA_FILE, step_dir / CONFIG_FILE
    try:
        metadata = read_metadata(step_dir)
    except (OSError, ValueError) as error:
        return [f"{metadata_path}: cannot be read ({getattr(error, 'strerror', None) or error})"]
    problems = []
    if metadata.step != step_of(step_dir):
        problems.append(f"{metadata_path}: says step {metadata.step}, but its directory is {step_dir.name}")
    layout = (metadata.tensor_parallel, metadata.pipeline_parallel, metadata.data_parallel)
    if metadata.world_size != layout[0] * layout[1] * layout[2]:
        problems.append(f"{metadata_path}: world_size {metadata.world_size} is not tensor x pipeline x data = "
                        f"{layout[0]} x {layout[1]} x {layout[2]}")
    problems += [f"{step_dir}: {problem} (according to {METADATA_FILE})" for problem in layout_problems(names, *layout)]
    try:
        saved_config_data(config_path)
    except ValueError as error:
        problems.append(str(error))
    except OSError as error:
        problems.append(f"{config_path}: cannot be read ({error.strerror or error})")
    return problems


def _unsafe(path: Path) -> str | None:
    names = unsafe_globals(path) if path.suffix == ".pt" else None
    return f"{path}: its pickle names {', '.join(names)}" if names else None


def check_step_dir(step_dir: str | os.PathLike, trust: Trust = Trust(), share: tuple[int, int] = (0, 1),
                   depth: str = FULL) -> Verdict:
    """Check one checkpoint (the module docstring's steps 1-6, to ``depth``).

    ``share`` = (rank, world size): hash and scan only this rank's share of the large files, each on
    the rank that wrote it when that rank exists (its page cache may still hold it), else spread by
    position; every rank checks the marker, the listing, the signature and lnstrain's small files.
    Every rank calls it with its share and the verdicts are merged (``Verdict.merge``).
    """
    step_dir = Path(step_dir)
    rank, world_size = share
    verdict = Verdict(step_dir)
    if is_link(step_dir):
        verdict.corrupt.append(f"{step_dir}: a symbolic link, which is never followed")
        return verdict
    try:
        marker = read_marker(step_dir)
    except FileNotFoundError:
        verdict.corrupt.append(f"{verdict.marker}: missing (its save was interrupted)")
        return verdict
    except MarkerError as error:
        verdict.corrupt.append(f"{verdict.marker}: damaged: {error}; nothing it records can be trusted")
        return verdict
    verdict.signed = "signature" in marker.content
    if trust.key is not None and marker.files is not None:
        checked = check_signature(marker.content, trust.key)
        verdict.signature, verdict.signature_detail = checked.state, checked.detail
    on_disk, odd = _walk(step_dir)
    verdict.corrupt += odd
    present = set(on_disk)
    if marker.files is None:
        verdict.recorded = False
        names, owners = on_disk, [i % world_size for i in range(len(on_disk))]
        own_files_ok = all(name in on_disk for name in _OWN_FILES)
        verdict.corrupt += [f"{step_dir / name}: missing (every save writes it)" for name in _OWN_FILES
                            if name not in on_disk]
    else:
        names = sorted(marker.files)
        owners = [marker.files[n].rank if marker.files[n].rank < world_size else i % world_size
                  for i, n in enumerate(names)]
        verdict.corrupt += [f"{step_dir / name}: not written by its save (not in {COMPLETE_MARKER}); DeepSpeed "
                            "would load it by its name" for name in on_disk if name not in marker.files]
        verdict.corrupt += [f"{step_dir}: its {COMPLETE_MARKER} does not record {name}, which every save writes"
                            for name in _OWN_FILES if name not in marker.files]
        own = [file_problem(step_dir, name, marker.files[name]) for name in _OWN_FILES if name in marker.files]
        verdict.corrupt += [problem for problem in own if problem]
        own_files_ok = not any(own) and all(name in marker.files for name in _OWN_FILES)
    if own_files_ok:
        verdict.corrupt += _content_problems(step_dir, names)
    for name, owner in zip(names, owners):
        if owner != rank:
            continue
        verdict.files += 1
        if marker.files is not None:
            verdict.bytes += marker.files[name].size
            if name not in _OWN_FILES:
                problem = file_problem(step_dir, name, marker.files[name], trust.checksums and depth == FULL)
                if problem:
                    verdict.corrupt.append(problem)
        if depth == FULL and name in present:
            unsafe = _unsafe(step_dir / name)
            if unsafe and name.startswith(f"{RNG_DIR}/"):
                verdict.altered.append(f"{unsafe}; lnstrain writes only tensors there, so the file was altered "
                                       "after its save, and no opt-in loads it")
            elif unsafe:
                verdict.unsafe.append(unsafe)
    return verdict


# --- choosing a checkpoint --------------------------------------------------------------------------
@dataclass
class Choice:
    """The checkpoint to use, or why there is none."""

    step_dir: Path | None
    skipped: list[str] = field(default_factory=list)
    """One line per problem of each checkpoint passed over, newest first."""
    refusal: str | None = None
    """Set when nothing may be loaded at all (``Verdict.refusal``)."""


def choose_checkpoint(start: Path, trust: Trust, fall_back: bool, check: Callable[[Path], Verdict],
                      purpose: str = "resume from", log: bool = True) -> Choice:
    """``start`` if ``check(start)`` passes under ``trust``, else (``fall_back``) the newest older
    complete checkpoint beside it that does. ``check`` is ``check_step_dir`` or, on resume, every
    rank's share of it merged. ``log``: name each skipped checkpoint's problems in the log."""
    candidates = [start]
    if fall_back:
        candidates += [p for p in reversed(complete_step_dirs(start.parent)) if step_of(p) < step_of(start)]
    skipped: list[str] = []
    for candidate in candidates:
        verdict = check(candidate)
        refusal = verdict.refusal(trust, purpose)
        if refusal:
            return Choice(None, skipped, refusal)
        reasons = verdict.skip_reasons(trust)
        if not reasons:
            if log:
                _log_accepted(verdict, trust, bool(skipped))
            return Choice(candidate, skipped)
        if log:
            next_move = "trying an older checkpoint" if candidate is not candidates[-1] else "no older checkpoint to try"
            logger.error("%s failed verification; %s:\n  %s", candidate, next_move, "\n  ".join(reasons))
        skipped += reasons
    return Choice(None, skipped)


def _log_accepted(verdict: Verdict, trust: Trust, fell_back: bool) -> None:
    if verdict.unsafe:
        logger.warning("%s: files beyond the allow-list will be fully unpickled (allow_pickle):\n  %s",
                       verdict.step_dir, "\n  ".join(verdict.unsafe))
    if not verdict.recorded:
        logger.warning("%s predates lnstrain's file checksums: its files are not verified (allow_unverified)",
                       verdict.step_dir)
    if verdict.signature == "unsigned":
        logger.warning("%s is not signed: used because of allow_unverified", verdict.step_dir)
    elif trust.key is None and verdict.signed:
        logger.info("%s is signed; no signing key given, so its signature is not checked", verdict.step_dir)
    if fell_back:
        logger.warning("using %s, the newest checkpoint whose files verify", verdict.step_dir)


def nothing_verifies(named: Path, explicit: bool, skipped: list[str], by_a_tool: bool = False) -> str:
    """The message when no checkpoint passes (every one skipped is named with its problems)."""
    if explicit:
        what = (f"{named} cannot be used; pick another global_step<N> "
                "(tools/verify_checkpoint.py says which are OK)")
    else:
        what = f"no checkpoint in {named.parent} can be used; restore the files" + (
            "" if by_a_tool else ", or start a new run (another run.name, or checkpoint.resume: none)")
    return f"cannot {'read the checkpoint' if by_a_tool else 'resume'}: {what}:\n    - " + "\n    - ".join(skipped)


def checkpoint_directory(path: Path) -> Path:
    """The directory holding a run's ``global_step<N>``: ``path`` itself or its (real) ``checkpoints/``."""
    if complete_step_dirs(path) or not (path / CHECKPOINTS_DIR).is_dir() or is_link(path / CHECKPOINTS_DIR):
        return path
    return path / CHECKPOINTS_DIR


def open_checkpoint(path: str | os.PathLike, trust: Trust, depth: str = FULL) -> Path:
    """The verified step directory a tool or ``checkpoint.init_from`` reads, for ``path``: one
    ``global_step<N>`` (used only if it verifies), or a checkpoint or run directory (its newest
    checkpoint that verifies, as a resume would choose). Raises ``CheckpointError`` saying why not."""
    path = Path(path)
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} does not exist (give a run directory, its checkpoints/ or a global_step<N>)")
    if step_of(path) is not None:
        if is_link(path):
            raise CheckpointError(f"{path} is a symbolic link, which lnstrain does not follow; give the directory "
                                  f"it points to ({os.path.realpath(path)})")
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint (its save was interrupted); pick another "
                                  "global_step<N> or the checkpoint directory")
        start, fall_back = path, False
    else:
        start = newest_checkpoint(checkpoint_directory(path))
        if start is None:
            raise CheckpointError(f"{path} holds no complete global_step<N> checkpoint (nor does its "
                                  f"{CHECKPOINTS_DIR}/)")
        fall_back = True
    choice = choose_checkpoint(start, trust, fall_back, lambda step_dir: check_step_dir(step_dir, trust, depth=depth),
                               purpose="read", log=False)
    if choice.refusal:
        raise CheckpointError(choice.refusal)
    if choice.step_dir is None:
        raise CheckpointError(nothing_verifies(start, not fall_back, choice.skipped, by_a_tool=True))
    if choice.skipped:
        logger.warning("using %s, the newest checkpoint that verifies; skipped:\n  %s", choice.step_dir,
                       "\n  ".join(choice.skipped))
    return choice.step_dir


def add_trust_arguments(parser: Any) -> None:
    """The opt-ins every tool that reads a checkpoint takes (``trust_from_arguments``)."""
    parser.add_argument("--allow-pickle", action="store_true",
                        help="fully unpickle DeepSpeed files that need it (only for checkpoints you trust)")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="use a checkpoint whose files cannot be verified: saved before lnstrain recorded "
                             "checksums, or, with --key, unsigned (never a damaged or forged one)")
    parser.add_argument("--key", metavar="FILE",
                        help="the run's checkpoint.signing_key_file: use only checkpoints signed with it")


def trust_from_arguments(args: Any, checkpoint: str | os.PathLike | None) -> Trust:
    """The ``Trust`` of a tool's command line; ``checkpoint``: the path it reads, which must not hold
    the key. Raises ``CheckpointError`` for an unusable key."""
    key = None
    if args.key:
        protected = [Path(checkpoint)] if checkpoint else []
        if checkpoint and step_of(checkpoint) is not None:
            protected.append(Path(checkpoint).parent.parent)  # the run directory of <run>/checkpoints/global_step<N>
        try:
            key = read_signing_key(args.key, protected)
        except KeyFileError as error:
            raise CheckpointError(str(error).replace("checkpoint.signing_key_file", "--key")) from None
    return Trust(allow_pickle=args.allow_pickle, allow_unverified=args.allow_unverified, key=key)
