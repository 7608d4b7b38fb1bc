"""Reading and writing inside run and checkpoint directories without following symbolic links.

lnstrain never creates a symbolic link in a run directory or a checkpoint directory, so one found
there was put there by someone else, and following it would read or write a file elsewhere: another
run's checkpoint, or any file its owner can write. Every file lnstrain opens there goes through
these functions: ``O_NOFOLLOW`` refuses a link as the last component, and directory entries are
looked at with ``lstat``. The run directory and ``checkpoint.dir`` themselves may be links (the
operator chose them); nothing inside them is followed (docs/checkpoints.md, "Threat model").
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class LinkRefused(OSError):
    """A path lnstrain would open is a symbolic link, or not a regular file."""


def is_link(path: str | os.PathLike) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def is_regular_file(path: str | os.PathLike) -> bool:
    """A regular file, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_directory(path: str | os.PathLike) -> bool:
    """A directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular_file(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path``; raises ``LinkRefused`` for a link or anything but a regular
    file (a FIFO would block the reader), ``FileNotFoundError`` when it is missing."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise LinkRefused(errno.ELOOP, "a symbolic link, which lnstrain does not follow", str(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise LinkRefused(errno.EINVAL, "not a regular file", str(path))
    return descriptor


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (``ValueError`` when larger)."""
    descriptor = open_regular_file(path)
    try:
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(descriptor)
    if len(data) > limit:
        raise ValueError(f"{path} holds more than the {limit} bytes such a file can have")
    return data


def create_exclusively(path: str | os.PathLike, mode: int = 0o666) -> int:
    """A new, empty file at ``path`` for writing: whatever was there under that name (a stale
    temporary file, or a link planted in its place) is removed first, and the file is created with
    ``O_EXCL``, so the descriptor is never a link's target."""
    try:
        os.unlink(path)  # removes a link itself, never what it points to
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)


def write_text_replacing(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a new temporary file beside ``path`` and rename it over ``path`` (a link at
    ``path`` is replaced, not followed)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    descriptor = create_exclusively(temporary)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)
