"""Reading and writing inside run and checkpoint directories without following links.

lnstrain never creates a symbolic link or a hard link in a run directory or a checkpoint directory,
so one found there was put there by someone else, and following it would read or write a file
elsewhere: another run's checkpoint, or any file its owner can write. Every file lnstrain opens there
goes through these functions: ``O_NOFOLLOW`` refuses a symbolic link as the last component, and
directory entries are looked at with ``lstat``. A hard link is a second name of a file elsewhere,
indistinguishable from it but for its link count: a file is never opened for writing in place
(``create_exclusively`` removes the name and creates a new file with ``O_EXCL``; ``write_text_replacing``
renames a new file over it), and a file read as trusted state must have one name only
(``open_regular_file``). The run directory and ``checkpoint.dir`` themselves may be links (the operator
chose them); nothing inside them is followed (docs/checkpoints.md, "Threat model").
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


def hard_link_detail(names: int) -> str:
    """Why a file with ``names`` names (a link count above 1) is not read: ``LinkRefused``'s words."""
    return (f"a file with {names} names (a hard link), which lnstrain never makes: its other name may be "
            "outside the run directory, and whoever can write that one changes this file too; copy the file "
            "(cp without -l) if it is yours")


def _open_one_named_file(path: str | os.PathLike, flags: int) -> int:
    """``os.open(path, flags)`` of a regular file with one name; ``LinkRefused`` otherwise."""
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise LinkRefused(errno.ELOOP, "a symbolic link, which lnstrain does not follow", str(path)) from None
        raise
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        os.close(descriptor)
        raise LinkRefused(errno.EINVAL, "not a regular file" if not stat.S_ISREG(status.st_mode)
                          else hard_link_detail(status.st_nlink), str(path))
    return descriptor


def open_regular_file(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path``; raises ``LinkRefused`` for a symbolic link, a file with
    other names (a hard link) or anything but a regular file (a FIFO would block the reader),
    ``FileNotFoundError`` when it is missing."""
    return _open_one_named_file(path, os.O_RDONLY)


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


def write_bytes_replacing(path: str | os.PathLike, data: bytes, executable: bool = False) -> None:
    """Write ``data`` to a new temporary file beside ``path`` and rename it over ``path`` (a link at
    ``path``, symbolic or hard, is replaced, not written through). ``executable``: also executable by
    its owner, set through the new file's own descriptor (never ``chmod`` of a name)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with os.fdopen(create_exclusively(temporary), "wb") as handle:
        handle.write(data)
        if executable:
            os.fchmod(handle.fileno(), os.fstat(handle.fileno()).st_mode | stat.S_IXUSR)
    os.replace(temporary, path)


def write_text_replacing(path: str | os.PathLike, text: str) -> None:
    """``write_bytes_replacing`` of ``text`` in UTF-8."""
    write_bytes_replacing(path, text.encode("utf-8"))


def open_for_appending(path: str | os.PathLike) -> int:
    """A descriptor that appends to the log ``path``, created if missing; ``LinkRefused`` for a
    symbolic link, a file with other names (a hard link) or anything but a regular file, whose target
    would get the lines instead."""
    return _open_one_named_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to the log ``path`` in one write (``open_for_appending``)."""
    descriptor = open_for_appending(path)
    try:
        os.write(descriptor, text.encode("utf-8"))
    finally:
        os.close(descriptor)


if __name__ == "__main__":  # the SLURM batch script's log line: python -m lnstrain.no_follow append FILE TEXT
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "append":
        sys.exit("usage: python -m lnstrain.no_follow append FILE TEXT")
    try:
        append_text(sys.argv[2], sys.argv[3] + "\n")
    except OSError as error:
        sys.exit(f"lnstrain: cannot append to {sys.argv[2]}: {error.strerror or error}")
