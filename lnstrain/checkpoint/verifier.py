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
import stat
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
from lnstrain.checkpoint.safe_load import OPT_IN, scan
from lnstrain.checkpoint.signing import KeyFileError, SigningKey, check_signature, read_signing_key
from lnstrain.no_follow import hard_link_detail, is_link
from lnstrain.report_lines import Findings, capped, escaped
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
    """What checking (a share of) one checkpoint found; every line names a file (escaped: names in a
    step directory are anyone's choice), at most a few lines of each kind (``report_lines.Findings``)."""

    step_dir: Path
    listing_findings: Findings = field(default_factory=Findings)
    """What every rank finds alike: the marker, the listing, sizes, lnstrain's own files, the metadata."""
    corrupt_findings: Findings = field(default_factory=Findings)
    """What this rank's share of the files' hashes found."""
    unsafe_findings: Findings = field(default_factory=Findings)
    altered_findings: Findings = field(default_factory=Findings)
    recorded: bool = True
    """False: the marker predates file records (UNVERIFIED)."""
    signed: bool = False
    """The marker carries a signature (checked only with a key)."""
    signature: str | None = None
    """With a key: ``signed``, ``unsigned`` or ``forged``."""
    signature_detail: str = ""
    read: bool = True
    """False: with a key, the marker's signature did not vouch for it (forged, or unsigned without
    ``allow_unverified``), so nothing it lists was looked at."""
    files: int = 0
    bytes: int = 0

    @property
    def corrupt(self) -> list[str]:
        """The marker damaged, a file missing, unlisted, truncated, altered or a link, the metadata wrong."""
        return self.listing_findings.lines + self.corrupt_findings.lines

    @property
    def unsafe(self) -> list[str]:
        """DeepSpeed's files whose pickle names classes beyond the allow-list, or that cannot be scanned."""
        return self.unsafe_findings.lines

    @property
    def altered(self) -> list[str]:
        """lnstrain's own RNG files whose pickle names classes beyond tensors: never written by a save."""
        return self.altered_findings.lines

    @property
    def marker(self) -> Path:
        return self.step_dir / COMPLETE_MARKER

    @property
    def ok(self) -> bool:
        return self.read and not self.corrupt and not self.unsafe_findings and not self.altered_findings

    def merge(self, other: "Verdict") -> None:
        """Add another rank's share (lines every share found are kept once)."""
        self.listing_findings.merge(other.listing_findings, same_things=True)
        for name in ("corrupt_findings", "unsafe_findings", "altered_findings"):
            getattr(self, name).merge(getattr(other, name))
        self.files += other.files
        self.bytes += other.bytes
        self.recorded = self.recorded and other.recorded
        self.signed = self.signed or other.signed
        self.read = self.read and other.read
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
ODD_ENTRIES = "entries no save writes (links, hard links, special files)"
UNLISTED = "files not written by its save"
MISSING_OR_RESIZED = "files missing or of another size than their save wrote"
ALTERED_BYTES = "files whose bytes differ from what their save wrote"
CONTENT = "problems in its metadata or config"
UNSAFE_PICKLES = "files whose pickle would run code, or cannot be scanned"


def _walk(step_dir: Path) -> tuple[dict[str, int], list[str]]:
    """({relative name: size} of the regular files under ``step_dir`` but its marker; a line for each
    entry that is a link, a file with other names (a hard link) or neither a file nor a directory).
    Links are never followed; each entry is looked at once (``lstat``)."""
    files: dict[str, int] = {}
    odd: list[str] = []
    pending = [step_dir]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                path = Path(entry.path)
                name = path.relative_to(step_dir).as_posix()
                try:
                    status = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while listing: the check of its record says so
                if stat.S_ISLNK(status.st_mode):
                    odd.append(f"{escaped(path)}: a symbolic link (to {escaped(os.readlink(path))}), which no save "
                               "writes; it is never followed")
                elif stat.S_ISDIR(status.st_mode):
                    pending.append(path)
                elif not stat.S_ISREG(status.st_mode):
                    odd.append(f"{escaped(path)}: not a regular file, which no save writes")
                elif status.st_nlink > 1:
                    odd.append(f"{escaped(path)}: {hard_link_detail(status.st_nlink)}")
                elif name != COMPLETE_MARKER:
                    files[name] = status.st_size
    return dict(sorted(files.items())), odd


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


def _size_problems(step_dir: Path, records: dict[str, FileRecord], sizes: dict[str, int], found: Findings) -> None:
    """``file_problem`` of every recorded file without reading any: its size as the listing found it
    (a marker can list any number of files: a line is made only for those ``found`` keeps)."""
    base = os.fspath(step_dir)
    for name, record in records.items():
        size = sizes.get(name)
        if size is None:
            if not os.path.lexists(os.path.join(base, name)):  # else not a regular file: the listing said so
                found.add(MISSING_OR_RESIZED, lambda name=name: f"{step_dir / name}: missing (its save wrote it)")
        elif size != record.size:
            found.add(MISSING_OR_RESIZED, lambda name=name, size=size, record=record: (
                f"{step_dir / name}: {size} bytes, but its save wrote {record.size} (truncated or overwritten)"))


def run_length_problems(metadata: Any, train: Any, seq_len: int, source: Path) -> list[str]:
    """Where the position ``metadata`` records is beyond what the run its config describes
    (``train``: its train section) could have reached: a step after its last, or more samples than
    its steps hold. Each save is of a position its run reached, so such a position was rewritten
    (both in the metadata and in DeepSpeed's record of it, or they would differ)."""
    try:
        steps = train.steps if train.steps is not None else -(-train.tokens // (train.global_batch_size * seq_len))
    except (TypeError, ZeroDivisionError):
        steps = None
    if not isinstance(steps, int) or steps < 1 or train.global_batch_size < 1:
        return [f"{source}: gives no length of run (train.steps or train.tokens, train.global_batch_size), which "
                "every saved config has"]
    problems = []
    if metadata.step > steps:
        problems.append(f"{source.parent / METADATA_FILE}: step {metadata.step} is after its run's last step "
                        f"({steps}, according to {source.name})")
    if metadata.consumed_samples > steps * train.global_batch_size:
        problems.append(f"{source.parent / METADATA_FILE}: consumed_samples {metadata.consumed_samples} is more "
                        f"than its run's {steps} steps of {train.global_batch_size} samples hold (according to "
                        f"{source.name}): the position was rewritten")
    return problems


def _config_problems(config_path: Path, metadata: Any) -> list[str]:
    """The step's config is one this lnstrain reads (known keys, right types), its model is valid for
    the saved layout, and its run could have reached the saved position."""
    from lnstrain.config.run_config import read_config

    try:
        typed = read_config(saved_config_data(config_path))
    except ValueError as error:
        return [escaped(str(error))]
    except OSError as error:
        return [f"{config_path}: cannot be read ({error.strerror or error})"]
    if typed.problems or typed.value is None:
        return [f"{config_path}: {escaped(problem)}; not a config this lnstrain reads" for problem in
                capped(typed.problems or ["it cannot be read as a run config"], "problems")]
    config = typed.value
    problems = [f"{config_path}: {problem}" for problem in
                capped(config.model.validate(tensor_parallel=metadata.tensor_parallel), "problems")]
    return problems + run_length_problems(metadata, config.train, config.data.seq_len, config_path)


def _content_problems(step_dir: Path, names: list[str]) -> list[str]:
    """The metadata and config parse, the metadata names this directory's step, its layout fits the
    files ``names`` and its position the run its config describes. Called only once both files
    verified (or for an UNVERIFIED checkpoint)."""
    metadata_path, config_path = step_dir / METADATA_FILE, step_dir / CONFIG_FILE
    try:
        metadata = read_metadata(step_dir)
    except (OSError, ValueError) as error:
        return [f"{metadata_path}: cannot be read ({escaped(getattr(error, 'strerror', None) or str(error))})"]
    problems = []
    if metadata.step != step_of(step_dir):
        problems.append(f"{metadata_path}: says step {metadata.step}, but its directory is {step_dir.name}")
    layout = (metadata.tensor_parallel, metadata.pipeline_parallel, metadata.data_parallel)
    if metadata.world_size != layout[0] * layout[1] * layout[2]:
        problems.append(f"{metadata_path}: world_size {metadata.world_size} is not tensor x pipeline x data = "
                        f"{layout[0]} x {layout[1]} x {layout[2]}")
    problems += [f"{step_dir}: {escaped(problem)} (according to {METADATA_FILE})"
                 for problem in layout_problems(names, *layout)]
    return problems + _config_problems(config_path, metadata)


def _unsafe(path: Path) -> str | None:
    if path.suffix != ".pt":
        return None
    found = scan(path)
    return f"{escaped(path)}: {escaped(found.describe())}" if found.unsafe else None


def _vouched_for(verdict: Verdict, marker: Any, trust: Trust) -> bool:
    """With a key, whether the marker's signature lets its files be read at all (checked first, so a
    forged marker listing a huge file costs nothing but its own parse)."""
    if trust.key is None or marker.files is None:
        return True
    checked = check_signature(marker.content, trust.key)
    verdict.signature, verdict.signature_detail = checked.state, checked.detail
    return checked.state == "signed" or (checked.state == "unsigned" and trust.allow_unverified)


def check_step_dir(step_dir: str | os.PathLike, trust: Trust = Trust(), share: tuple[int, int] = (0, 1),
                   depth: str = FULL) -> Verdict:
    """Check one checkpoint (the module docstring's steps 1-6, to ``depth``), cheapest first: with a
    key the signature before anything it lists, then the listing and every file's size (one ``lstat``
    each), and only when all of that holds the hashes and the pickles.

    ``share`` = (rank, world size): hash and scan only this rank's share of the large files, each on
    the rank that wrote it when that rank exists (its page cache may still hold it), else spread by
    position; every rank checks the marker, the listing, the sizes, the signature and lnstrain's small
    files. Every rank calls it with its share and the verdicts are merged (``Verdict.merge``).
    """
    step_dir = Path(step_dir)
    rank, world_size = share
    verdict = Verdict(step_dir)
    listing = verdict.listing_findings
    if is_link(step_dir):
        listing.add(ODD_ENTRIES, f"{step_dir}: a symbolic link, which is never followed")
        return verdict
    try:
        marker = read_marker(step_dir)
    except FileNotFoundError:
        listing.add(CONTENT, f"{verdict.marker}: missing (its save was interrupted)")
        return verdict
    except MarkerError as error:
        listing.add(CONTENT, f"{verdict.marker}: damaged: {escaped(str(error))}; nothing it records can be trusted")
        return verdict
    verdict.signed = "signature" in marker.content
    if not _vouched_for(verdict, marker, trust):
        verdict.read = False
        return verdict
    sizes, odd = _walk(step_dir)
    listing.extend(ODD_ENTRIES, odd)
    if marker.files is None:
        verdict.recorded = False
        names, owners = list(sizes), [i % world_size for i in range(len(sizes))]
        listing.extend(CONTENT, [f"{step_dir / name}: missing (every save writes it)" for name in _OWN_FILES
                                 if name not in sizes])
    else:
        names = sorted(marker.files)
        owners = [marker.files[n].rank if marker.files[n].rank < world_size else i % world_size
                  for i, n in enumerate(names)]
        listing.extend(UNLISTED, [f"{escaped(step_dir / name)}: not written by its save (not in {COMPLETE_MARKER}); "
                                  "DeepSpeed would load it by its name" for name in sizes if name not in marker.files])
        listing.extend(CONTENT, [f"{step_dir}: its {COMPLETE_MARKER} does not record {name}, which every save writes"
                                 for name in _OWN_FILES if name not in marker.files])
        _size_problems(step_dir, marker.files, sizes, listing)
    for name, owner in zip(names, owners):
        if owner == rank:
            verdict.files += 1
            verdict.bytes += marker.files[name].size if marker.files is not None else 0
    if listing:
        return verdict  # nothing read: what is there is not what its save wrote
    if marker.files is not None:
        listing.extend(CONTENT, filter(None, (file_problem(step_dir, name, marker.files[name]) for name in _OWN_FILES)))
    if not listing:
        listing.extend(CONTENT, _content_problems(step_dir, names))
    if listing or depth != FULL:
        return verdict
    for name, owner in zip(names, owners):
        if owner != rank:
            continue
        if marker.files is not None and name not in _OWN_FILES and trust.checksums:
            problem = file_problem(step_dir, name, marker.files[name])
            if problem:
                verdict.corrupt_findings.add(ALTERED_BYTES, problem)
        unsafe = _unsafe(step_dir / name)
        if unsafe and name.startswith(f"{RNG_DIR}/"):
            verdict.altered_findings.add(UNSAFE_PICKLES, f"{unsafe}; lnstrain writes only tensors there, so the file "
                                                         "was altered after its save, and no opt-in loads it")
        elif unsafe:
            verdict.unsafe_findings.add(UNSAFE_PICKLES, unsafe)
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
