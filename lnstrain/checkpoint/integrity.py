"""What a checkpoint's completion marker records about its files, and how it is written and read.

Each save records every file it wrote in ``lnstrain_complete``: path (relative to the step
directory), size, SHA-256 and the rank that wrote it. DeepSpeed's files are hashed while they are
written (``recording_deepspeed_files`` streams torch's writer through ``ChecksumWriter``, so the
shards are never read back); lnstrain's few small files (metadata, config, RNG states) are read back
once after writing. With ``checkpoint.signing_key_file`` the marker is also signed
(``lnstrain.checkpoint.signing``). Checking a checkpoint against its marker is
``lnstrain.checkpoint.verifier``'s.

``read_marker`` is strict: a marker is either the JSON this module writes, or exactly what an
lnstrain before file records wrote (a time and a newline: ``Marker.files`` is None); anything else
(a flipped bit, an empty file, a truncated one) is damaged, never taken for the older format.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lnstrain.checkpoint.engine_hooks import replaced
from lnstrain.checkpoint.metadata import COMPLETE_MARKER, write_atomically
from lnstrain.checkpoint.signing import SigningKey, signature
from lnstrain.deepspeed_adapter import CheckpointFileIO, torch_save_zip_format
from lnstrain.no_follow import create_exclusively, open_regular_file, read_regular_file

CHECKSUM = "sha256"
MARKER_FORMAT = 3
"""What this lnstrain writes (``MARKER_FORMATS``)."""
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
    """Size and SHA-256 of a regular file on disk (read in 8 MiB chunks; a link is refused:
    ``no_follow.LinkRefused``)."""
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(open_regular_file(path), "rb") as handle:
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
        with os.fdopen(create_exclusively(path), "wb") as raw:  # a new file: never a planted link's target
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
# --- the completion marker ----------------------------------------------------------------------------
MARKER_FORMATS = (2, 3)
"""Formats read: 1, a time only (``LEGACY_MARKER``); 2, every file's record (``files``); 3, also the
step directory's name (``step_dir``) and, with a signing key, ``signature``."""
LEGACY_MARKER = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?\n")
MAX_MARKER_BYTES = 64 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class MarkerError(ValueError):
    """A completion marker that is neither this module's JSON nor the older time-only marker."""


@dataclass(frozen=True)
class Marker:
    """A parsed completion marker."""

    files: dict[str, FileRecord] | None
    """Every file its save wrote; None for a marker written before lnstrain recorded files."""
    content: dict[str, Any] = field(default_factory=dict)
    """The marker's JSON (what a signature covers)."""


def marker_text(step_dir_name: str, records: dict[str, FileRecord], key: SigningKey | None = None) -> str:
    files = {name: asdict(records[name]) for name in sorted(records)}
    content: dict[str, Any] = {"format": MARKER_FORMAT, "saved_at": time.time(), "checksum": CHECKSUM,
                               "step_dir": step_dir_name, "files": files}
    if key is not None:
        content["signature"] = signature(content, key)
    return json.dumps(content, indent=1) + "\n"


def write_marker(step_dir: Path, records: dict[str, FileRecord], key: SigningKey | None) -> None:
    """Write ``step_dir``'s completion marker recording ``records`` (every rank's files), signed
    with ``key`` when given: the step that makes the checkpoint complete."""
    write_atomically(step_dir / COMPLETE_MARKER, marker_text(step_dir.name, records, key))


def safe_relative_name(name: Any) -> bool:
    """A path a marker may record: relative, inside its directory, in POSIX form, nothing odd."""
    if not isinstance(name, str) or not name or len(name) > 1024 or "\\" in name or not name.isprintable():
        return False  # lnstrain writes plain names: a control character would only forge a log line
    parts = name.split("/")
    return all(part not in ("", ".", "..") and len(part) <= 255 for part in parts) and name != COMPLETE_MARKER


def _record(name: str, entry: Any) -> FileRecord:
    if not safe_relative_name(name):
        raise MarkerError(f"it records {str(name)[:200]!r}, which is not a file name inside its directory")
    if not isinstance(entry, dict):
        raise MarkerError(f"its record of {name} is not a mapping")
    size, sha256, rank = entry.get("size"), entry.get("sha256"), entry.get("rank")
    if not (type(size) is int and size >= 0 and type(rank) is int and rank >= 0
            and isinstance(sha256, str) and _SHA256_HEX.fullmatch(sha256)):
        raise MarkerError(f"its record of {name} is malformed ({entry!r:.120})")
    return FileRecord(size, sha256, rank)


def parse_marker(data: bytes, step_dir_name: str) -> Marker:
    """The marker ``data`` of directory ``step_dir_name``; raises ``MarkerError`` saying what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise MarkerError("it is not UTF-8 text") from None
    if LEGACY_MARKER.fullmatch(text):
        return Marker(None)
    try:
        content = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise MarkerError(f"it is not the JSON lnstrain writes ({error})" if text else "it is empty") from None
    if not isinstance(content, dict):
        raise MarkerError("it is not a JSON object")
    if content.get("format") not in MARKER_FORMATS or content.get("checksum") != CHECKSUM:
        raise MarkerError(f"format {content.get('format')!r} with checksum {content.get('checksum')!r} is not one "
                          f"this lnstrain reads (formats {MARKER_FORMATS}, {CHECKSUM})")
    if content["format"] >= 3 and content.get("step_dir") != step_dir_name:
        raise MarkerError(f"it was written for {content.get('step_dir')!r}, not {step_dir_name} (a renamed "
                          "or copied directory)")
    files = content.get("files")
    if not isinstance(files, dict) or not files:
        raise MarkerError("it records no files")
    return Marker({name: _record(name, entry) for name, entry in files.items()}, content)


def read_marker(step_dir: str | os.PathLike) -> Marker:
    """``step_dir``'s completion marker. Raises ``FileNotFoundError`` when there is none (an
    interrupted save), ``MarkerError`` when it is damaged (or a link, or not a regular file)."""
    path = Path(step_dir) / COMPLETE_MARKER
    try:
        data = read_regular_file(path, MAX_MARKER_BYTES)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        raise MarkerError(f"it cannot be read ({getattr(error, 'strerror', None) or error})") from None
    return parse_marker(data, Path(step_dir).name)
