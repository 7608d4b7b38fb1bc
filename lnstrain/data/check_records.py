"""Records of the checks of cached indices, shared by one user's processes on one node during a launch.

Every rank must use only a cached index it knows was checked (``index_check``); the ranks of a node map
the same files through the same page cache, so one check per node is enough if the others can tell
that the files they map are the ones checked. The first process to take an entry's lock checks it and
leaves a record: each file's identity (device, inode, size, modification and change times) taken from
the very descriptor it mapped, and the check's verdict. The others, finding the record, use the files
unchecked; a failed check's record sends them to wait for the rebuild without checking again.

A record is trusted only when all of these hold, so a trusted record says what a check by this process
would have said:

* it lies in a directory this user owns and no one else can write (``<tmp>/lnstrain-<uid>``, mode
  0700, in a parent where others cannot rename it), never beside the data;
* every file still has the identity recorded: any write to a file sets its change time (``st_ctime``),
  which no user can set back, and a new file under the name has another inode or change time;
* the check began after this process started (this launch) and in this boot;
* for a check that passed, the files had last changed at least ``SETTLED_S`` seconds before it began, so
  a change within the file system's timestamp granularity cannot have left the change time as it was
  (a failed check's record is trusted without: it only makes a process wait for the rebuild).

Nothing else is needed from the other ranks: no collective, no agreement on local ranks; a process
that cannot have a private directory (or runs without ``/proc``) simply checks for itself.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable

from lnstrain.no_follow import read_regular_file, write_text_replacing

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
"""Bumped whenever what ``index_check`` accepts changes: records of another check are not trusted."""

SETTLED_S = 2.0
"""How long before a check its files must have last changed for its record to be trusted (a file
system's timestamp granularity is at most a few milliseconds on Linux's, 1-2 s on older ones)."""

KEEP_S = 7 * 86400.0
"""Records older than this are removed when a record is written (no one trusts them: they are from
earlier launches)."""

Identity = tuple[tuple[str, tuple[int, int, int, int, int]], ...]
"""(array key, (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)) of each file of a cache entry."""


def file_identity(status: os.stat_result) -> tuple[int, int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _boot_clock() -> tuple[str, float, float] | None:
    """(boot id, this process's start, now), both in seconds since boot; None off Linux."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot_id = handle.read().strip()
        with open("/proc/self/stat", encoding="ascii", errors="replace") as handle:
            started_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        return boot_id, started_ticks * tick + tick, time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _others_can_replace(path: str) -> bool:
    """Whether another user (not root) could rename ``path`` or a directory above it and put theirs in its
    place: a directory above owned by someone else, or writable by others without the sticky bit."""
    path = os.path.realpath(path)
    while True:
        status = os.stat(path)
        if status.st_uid not in (0, os.getuid()) or status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX:
            return True
        if path == os.path.dirname(path):
            return False
        path = os.path.dirname(path)


def _private_directory(parent: str) -> str | None:
    """``<parent>/lnstrain-<uid>``, created if missing, when only this user can write it; else None."""
    uid = os.getuid()
    path = os.path.join(parent, f"lnstrain-{uid}")
    try:
        if _others_can_replace(parent):
            return None
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        status = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != uid or status.st_mode & 0o022:
        return None
    return path


class CheckRecords:
    """Records of checks in ``directory`` (one only this user can write: use ``for_this_node``)."""

    def __init__(self, directory: str, clock: tuple[str, float, float]):
        self.directory = directory
        self.boot_id, self.process_started, _ = clock
        self.host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname())[:64]

    @classmethod
    def for_this_node(cls, parent: str | None = None) -> CheckRecords | None:
        """Records in this user's private directory under ``parent`` (default: the system's temporary
        directory, ``$TMPDIR``), or None where there can be none (this process then checks for itself)."""
        clock = _boot_clock()
        directory = _private_directory(parent or tempfile.gettempdir())
        if clock is None or directory is None:
            logger.info("cached indices are checked by every rank: no private directory for check records in %s",
                        parent or tempfile.gettempdir())
            return None
        return cls(directory, clock)

    def _path(self, entry: str) -> str:
        digest = hashlib.sha256(os.path.abspath(entry).encode("utf-8", "surrogateescape")).hexdigest()[:32]
        return os.path.join(self.directory, f"index-check-{digest}-{self.host}")

    def checked(self, entry: str, identity: Identity, check: Callable[[], str | None], deadline: float) -> str | None:
        """The verdict on the files of ``entry`` (its marker's path) whose identity is ``identity``: a
        trusted record's, or ``check()``'s, recorded for the others. Waits for the entry's lock until
        ``deadline`` (``time.monotonic``), then checks without it."""
        path = self._path(entry)
        try:
            lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return check()
        try:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return check()
                    time.sleep(0.05)
            recorded = self._trusted(path, entry, identity)
            if recorded is not None:
                return recorded[0]
            began, began_wall = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
            problem = check()
            self._write(path, {"version": RECORD_VERSION, "entry": os.path.abspath(entry), "boot_id": self.boot_id,
                               "began": began, "began_wall": began_wall, "files": [[k, list(v)] for k, v in identity],
                               "problem": problem})
            return problem
        finally:
            os.close(lock)  # releases the lock

    def _trusted(self, path: str, entry: str, identity: Identity) -> tuple[str | None] | None:
        """(the verdict,) of the record at ``path`` when it may be trusted for these files, else None."""
        try:
            record = json.loads(read_regular_file(f"{path}.json", 1 << 16))
            files = tuple((key, tuple(value)) for key, value in record["files"])
            problem = None if record["problem"] is None else str(record["problem"])
            settled = all(record["began_wall"] - ctime_ns / 1e9 >= SETTLED_S for _, (*_, ctime_ns) in identity)
            trusted = (record["version"] == RECORD_VERSION and record["entry"] == os.path.abspath(entry)
                       and record["boot_id"] == self.boot_id and record["began"] >= self.process_started
                       and files == identity and (settled or problem is not None))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return (problem,) if trusted else None

    def _write(self, path: str, record: dict) -> None:
        try:
            write_text_replacing(f"{path}.json", json.dumps(record))
            now = time.time()
            for name in os.listdir(self.directory):
                old = os.path.join(self.directory, name)
                if name.startswith("index-check-") and now - os.lstat(old).st_mtime > KEEP_S:
                    os.unlink(old)
        except OSError as error:  # the others check for themselves
            logger.debug("cannot write the check record %s: %s", path, error)
