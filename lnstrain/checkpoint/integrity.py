"""What a checkpoint's completion marker records about its files, and checking files against it.

Each save records every file it wrote in ``lnstrain_complete``: path (relative to the step
directory), size, SHA-256 and the rank that wrote it. DeepSpeed's files are hashed while they are
written (``recording_deepspeed_files`` streams torch's writer through ``ChecksumWriter``, so the
shards are never read back); lnstrain's few small files (metadata, config, RNG states) are read back
once after writing. A file whose size or hash differs, or that is missing or unreadable, makes the
checkpoint fail verification; a checkpoint whose marker predates these records (an older lnstrain) is
reported as unverified and still used.

``check_step_dir`` also lists the classes a ``.pt`` file's pickle names beyond what
``lnstrain.checkpoint.safe_load`` allows, read without unpickling, so every rank can agree that a
checkpoint is unsafe before any of them loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lnstrain.checkpoint.engine_hooks import replaced
from lnstrain.checkpoint.metadata import COMPLETE_MARKER, RNG_DIR
from lnstrain.checkpoint.safe_load import unsafe_globals
from lnstrain.deepspeed_adapter import CheckpointFileIO, torch_save_zip_format

CHECKSUM = "sha256"
MARKER_FORMAT = 2
"""1: the marker held a time only; 2: it also records every file (``files``)."""
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as its save wrote it."""

    size: int
    sha256: str
    rank: int
    """The global rank that wrote it: verification reads it on the same rank when it can."""


class ChecksumWriter:
    """A write-only binary file for ``torch.save`` that hashes the bytes on their way to ``raw``.

    It has no ``seek`` or ``tell``: torch's writer must produce the file front to back, so the hash
    is of exactly the bytes on disk (a writer that needed to seek would fail instead). A large buffer
    is hashed on a helper thread while it is written (both release the GIL), so hashing adds little
    to the save when the disk is not faster than SHA-256; each ``write`` returns only when both are
    done, as torch may reuse the buffer afterwards.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.size = 0
        self._hash = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lnstrain-sha256")

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size < _CHUNK:
            self._hash.update(data)
            written = self.raw.write(data)
        else:
            hashed = self._hasher.submit(self._hash.update, data)
            written = self.raw.write(data)
            hashed.result()
        self.size += size
        return written

    def flush(self) -> None:
        self.raw.flush()

    def record(self, rank: int) -> FileRecord:
        return FileRecord(self.size, self._hash.hexdigest(), rank)

    def close(self) -> None:
        self._hasher.shutdown()


def file_record(path: str | os.PathLike, rank: int) -> FileRecord:
    """Size and SHA-256 of a file on disk (read in 8 MiB chunks)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(size, digest.hexdigest(), rank)


def relative_name(step_dir: Path, path: str | os.PathLike) -> str | None:
    """``path`` relative to ``step_dir`` (POSIX separators), None when outside it."""
    try:
        return Path(os.path.abspath(path)).relative_to(os.path.abspath(step_dir)).as_posix()
    except ValueError:
        return None


@contextlib.contextmanager
def recording_deepspeed_files(file_io: CheckpointFileIO, step_dir: Path,
                              rank: int) -> Iterator[dict[str, FileRecord]]:
    """While DeepSpeed's ``save_checkpoint`` runs, record every file it writes through ``file_io``
    (``TrainingEngine.checkpoint_files``) under ``step_dir``.

    With DeepSpeed's torch checkpoint engine each file is written through ``ChecksumWriter`` (the
    same ``torch.save`` call, to a stream instead of a path); any other checkpoint engine writes as
    it does, and its files are read back afterwards.
    """
    records: dict[str, FileRecord] = {}
    written: list[str] = []
    original = file_io.save
    zip_format = torch_save_zip_format(file_io)
    streams = zip_format is not None

    def save(state_dict: Any, path: str) -> None:
        name = relative_name(step_dir, path)
        if not streams:
            original(state_dict, path)
            if name is not None:
                written.append(path)
            return
        with open(path, "wb") as raw:
            writer = ChecksumWriter(raw)
            try:
                torch.save(state_dict, writer, _use_new_zipfile_serialization=zip_format)
            finally:
                writer.close()
        if name is not None:
            records[name] = writer.record(rank)

    with replaced(file_io, "save", save):
        yield records
    for path in written:
        records[relative_name(step_dir, path)] = file_record(path, rank)


# --- the completion marker ----------------------------------------------------------------------------
def marker_text(records: dict[str, FileRecord]) -> str:
    files = {name: asdict(records[name]) for name in sorted(records)}
    return json.dumps({"format": MARKER_FORMAT, "saved_at": time.time(), "checksum": CHECKSUM, "files": files},
                      indent=1) + "\n"


def read_manifest(step_dir: str | os.PathLike) -> dict[str, FileRecord] | None:
    """The files ``step_dir``'s completion marker records; None for a marker without records (written
    by an lnstrain before they existed). Raises ``ValueError`` for a marker that cannot be parsed."""
    path = Path(step_dir) / COMPLETE_MARKER
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("{"):
        return None
    try:
        files = json.loads(text)["files"]
        return {name: FileRecord(int(entry["size"]), str(entry["sha256"]), int(entry["rank"]))
                for name, entry in files.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is damaged ({type(error).__name__}: {error})") from error


# --- checking files ---------------------------------------------------------------------------------
def file_problem(step_dir: Path, name: str, record: FileRecord, checksum: bool = True) -> str | None:
    """Why ``step_dir/name`` is not what its save wrote (missing, other size, other bytes; the bytes
    only with ``checksum``), or None."""
    path = step_dir / name
    try:
        size = path.stat().st_size
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


def unsafe_problem(path: Path) -> str | None:
    """What a ``.pt`` file's pickle names beyond the allow-list, or None (also for a file that cannot
    be inspected: the loader refuses or rejects it then)."""
    if path.suffix != ".pt":
        return None
    names = unsafe_globals(path)
    if not names:
        return None
    return f"{path}: its pickle names {', '.join(names)}"


@dataclass
class Verdict:
    """What checking (a share of) one checkpoint's files found."""

    step_dir: Path
    corrupt: list[str] = field(default_factory=list)
    """Missing, truncated, altered or unreadable files (one line each, naming the file)."""
    unsafe: list[str] = field(default_factory=list)
    """DeepSpeed's files whose pickle names classes beyond the allow-list (loading them could run code;
    ``checkpoint.allow_pickle`` loads them for a trusted checkpoint)."""
    altered: list[str] = field(default_factory=list)
    """lnstrain's own files (RNG state) whose pickle names classes beyond tensors: lnstrain never
    writes such a file, so it was altered after its save, and no opt-in loads it."""
    recorded: bool = True
    """False: the marker predates file records; sizes and contents could not be checked."""
    files: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.unsafe and not self.altered

    def merge(self, other: "Verdict") -> None:
        self.corrupt += other.corrupt
        self.unsafe += other.unsafe
        self.altered += other.altered
        self.files += other.files
        self.bytes += other.bytes
        self.recorded = self.recorded and other.recorded


def _files_on_disk(step_dir: Path) -> list[str]:
    return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                  if p.is_file() and p.name != COMPLETE_MARKER and not p.name.startswith("."))


def check_step_dir(step_dir: str | os.PathLike, share: tuple[int, int] = (0, 1), checksums: bool = True) -> Verdict:
    """Check ``step_dir``'s files against its completion marker, and scan its ``.pt`` files' pickles.

    ``share`` = (rank, world size): check only this rank's share of the files, each file on the rank
    that wrote it when that rank exists (its page cache may still hold it), else spread by position.
    Every rank calls it with its share and the verdicts are merged (``Verdict.merge``). Without
    ``checksums`` files are compared by size only (``checkpoint.verify_checksums: false``).
    """
    step_dir = Path(step_dir)
    rank, world_size = share
    verdict = Verdict(step_dir)
    try:
        manifest = read_manifest(step_dir)
    except (OSError, ValueError) as error:
        verdict.corrupt.append(f"{step_dir / COMPLETE_MARKER}: cannot be read: {error}")
        return verdict
    if manifest is None:
        verdict.recorded = False
        names = _files_on_disk(step_dir)
        owners = [i % world_size for i in range(len(names))]
    else:
        names = sorted(manifest)
        owners = [manifest[n].rank if manifest[n].rank < world_size else i % world_size for i, n in enumerate(names)]
    for name, owner in zip(names, owners):
        if owner != rank:
            continue
        if manifest is not None:
            problem = file_problem(step_dir, name, manifest[name], checksums)
            if problem:
                verdict.corrupt.append(problem)
            verdict.bytes += manifest[name].size
        verdict.files += 1
        unsafe = unsafe_problem(step_dir / name) if (step_dir / name).is_file() else None
        if unsafe and name.startswith(f"{RNG_DIR}/"):
            verdict.altered.append(f"{unsafe}; lnstrain writes only tensors there, so the file was altered "
                                   "after its save, and no opt-in loads it")
        elif unsafe:
            verdict.unsafe.append(unsafe)
    return verdict
