"""Signing a checkpoint's completion marker with a key kept outside the run directory.

A checksum proves a file is what its record says; anyone who can write the run directory can also
rewrite the record. With ``checkpoint.signing_key_file`` the marker carries an HMAC-SHA256, under
that key, of everything it records (every file's name, size and SHA-256, which include the
metadata and config files, the step directory's name, the marker's format and time). Without the
key nobody can make a marker whose signature verifies, so a reader holding the key tells:

    signed    the signature verifies: the marker is the one a trainer holding the key wrote
    unsigned  no signature (saved without a key, or the signature was removed)
    forged    a signature that does not verify: the marker, or the key, is not the one it was signed with

The key is the file's bytes (trailing whitespace removed), at least 32 of them, readable by its
owner only (like an SSH key), and never inside the run or checkpoint directory it protects.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 32
_MAX_KEY_BYTES = 1 << 16
_KEY_ID_SALT = b"lnstrain checkpoint signing key id\x00"
MAKE_A_KEY = "make one with: openssl rand -hex 32 > FILE && chmod 600 FILE (outside the run directory)"


@dataclass(frozen=True)
class SigningKey:
    """A key read from ``path``; ``key_id`` names it in markers without revealing it."""

    path: Path
    secret: bytes

    @property
    def key_id(self) -> str:
        return hashlib.sha256(_KEY_ID_SALT + self.secret).hexdigest()[:16]

    def __repr__(self) -> str:  # never print the secret
        return f"SigningKey({str(self.path)!r}, key_id={self.key_id})"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names it and says what to do."""


def _inside(path: Path, directory: Path) -> bool:
    try:
        return path.resolve().is_relative_to(Path(directory).resolve())
    except OSError:
        return False


def read_signing_key(path: str | os.PathLike, protected: list[Path] = ()) -> SigningKey:
    """The key in ``path``; ``protected``: directories the key must not lie in (the run and
    checkpoint directories it signs). Raises ``KeyFileError``."""
    path = Path(path).expanduser()
    for directory in protected:
        if _inside(path, directory):
            raise KeyFileError(f"checkpoint.signing_key_file {path} lies inside {directory}, which it protects: "
                               "anyone who can write that directory could read or replace the key; keep it "
                               "elsewhere (your home directory, a secrets store)")
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise KeyFileError(f"checkpoint.signing_key_file {path} does not exist; {MAKE_A_KEY}") from None
    except OSError as error:
        raise KeyFileError(f"checkpoint.signing_key_file {path} cannot be read ({error.strerror})") from None
    if not stat.S_ISREG(status.st_mode):
        raise KeyFileError(f"checkpoint.signing_key_file {path} is not a regular file")
    if status.st_mode & 0o077:
        raise KeyFileError(f"checkpoint.signing_key_file {path} can be read or written by others (mode "
                           f"{stat.S_IMODE(status.st_mode):o}); anyone who reads it can forge checkpoints: "
                           f"chmod 600 {path}")
    try:
        with open(path, "rb") as handle:
            secret = handle.read(_MAX_KEY_BYTES + 1).rstrip()
    except OSError as error:
        raise KeyFileError(f"checkpoint.signing_key_file {path} cannot be read ({error.strerror})") from None
    if len(secret) > _MAX_KEY_BYTES:
        raise KeyFileError(f"checkpoint.signing_key_file {path} is larger than {_MAX_KEY_BYTES} bytes: not a key")
    if len(secret) < MIN_KEY_BYTES:
        raise KeyFileError(f"checkpoint.signing_key_file {path} holds {len(secret)} bytes, fewer than "
                           f"{MIN_KEY_BYTES}; {MAKE_A_KEY}")
    return SigningKey(path, secret)


def canonical_bytes(content: dict[str, Any]) -> bytes:
    """The bytes a signature covers: the marker's content without its signature, as sorted, compact
    JSON (the same for every writer and reader)."""
    unsigned = {key: value for key, value in content.items() if key != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def signature(content: dict[str, Any], key: SigningKey) -> dict[str, str]:
    """The ``signature`` entry of a marker whose other entries are ``content``."""
    value = hmac.new(key.secret, canonical_bytes(content), hashlib.sha256).hexdigest()
    return {"algorithm": ALGORITHM, "key_id": key.key_id, "value": value}


@dataclass(frozen=True)
class SignatureCheck:
    """What a key says of one marker: ``state`` is ``signed``, ``unsigned`` or ``forged``."""

    state: str
    detail: str


def check_signature(content: dict[str, Any], key: SigningKey) -> SignatureCheck:
    """Whether the marker ``content`` (parsed JSON, signature included) was signed with ``key``."""
    entry = content.get("signature")
    if entry is None:
        return SignatureCheck("unsigned", "its marker carries no signature (saved without "
                                          "checkpoint.signing_key_file, or the signature was removed)")
    if not isinstance(entry, dict) or entry.get("algorithm") != ALGORITHM or not isinstance(entry.get("value"), str):
        return SignatureCheck("forged", "its marker's signature is malformed")
    expected = signature(content, key)
    if hmac.compare_digest(expected["value"], entry["value"]):
        return SignatureCheck("signed", f"signed with key {key.key_id}")
    if entry.get("key_id") != key.key_id:
        return SignatureCheck("forged", f"its signature does not verify with key {key.key_id} ({key.path}); the "
                                        f"marker names key {entry.get('key_id')!r}: signed with another key, or forged")
    return SignatureCheck("forged", f"its signature does not verify with key {key.key_id} ({key.path}): the marker "
                                    "was changed after it was signed")
