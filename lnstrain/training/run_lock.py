"""One trainer per run directory: rank 0 holds an exclusive lock on it for the whole of ``pretrain``.

Two trainers on one run directory (the same command started twice, a study launched from two
shells, a resubmitted job while the first still runs) would both save ``global_step<N>/`` and
``latest`` and overwrite each other's checkpoints. The second one to start stops instead, on every
rank, with exit 2 and a message naming the holder (host, PID, start time, SLURM job).

The lock is ``flock`` on ``<dir>/.lnstrain.lock`` (``run_files.RUN_LOCK_FILE``) in the run directory
and, when it lies elsewhere, the checkpoint directory. The kernel releases it when the holder exits,
however it ends (a SIGKILL or an out-of-memory kill included), so there is no stale lock to clean up
and the file itself is left in place (deleting it would let a second trainer lock a new file while
the first holds the old one). Linux's NFS client forwards ``flock`` to the server's lock manager, so
trainers on different nodes see each other's locks; a file system without locks (Lustre mounted
without ``-o flock``, for one) is logged as a warning and the run goes ahead unprotected.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from lnstrain.no_follow import hard_link_detail, read_regular_file
from lnstrain.report_lines import escaped
from lnstrain.run_files import RUN_LOCK_FILE

logger = logging.getLogger(__name__)

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_TRIES = 10


class RunDirectoryInUse(RuntimeError):
    """Another trainer holds the run directory; every rank raises it with the same message."""


def lock_directories(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """The directories a trainer writes and must hold alone: the run directory, and the checkpoint
    directory when it is not inside it."""
    run_dir, checkpoint_dir = Path(run_dir), Path(checkpoint_dir)
    inside = checkpoint_dir.resolve().is_relative_to(run_dir.resolve())
    return [run_dir] if inside else [run_dir, checkpoint_dir]


def _holder_record() -> str:
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if os.environ.get("SLURM_JOB_ID"):
        record["slurm_job"] = os.environ["SLURM_JOB_ID"]
    return json.dumps(record) + "\n"


def describe_holder(lock_path: Path) -> str:
    """Who holds ``lock_path``, as its holder recorded it (or why that is unknown); escaped, since
    anyone who can write the run directory can write the record."""
    try:
        record = json.loads(read_regular_file(lock_path, 1 << 12))
        described = f"PID {record['pid']} on {record['host']}, since {record['started']}"
        return escaped(described + (f", SLURM job {record['slurm_job']}" if record.get("slurm_job") else ""))
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def in_use_message(directory: Path) -> str:
    lock_path = directory / RUN_LOCK_FILE
    return (f"{directory} is in use by another trainer ({describe_holder(lock_path)}): two trainers on one "
            f"run directory overwrite each other's checkpoints; wait for it to end or stop it, or give this run "
            f"another run.name or run.output_dir")


def _unsupported(directory: Path, error: OSError) -> None:
    logger.warning("cannot lock %s (%s): this file system has no flock; nothing stops a second trainer on "
                   "this run directory", directory, error.strerror or error)


def probe(directory: Path) -> str | None:
    """The in-use message when a trainer holds ``directory`` now, else None (takes no lock; every
    rank can probe at once: probes share, only a trainer's lock excludes)."""
    lock_path = Path(directory) / RUN_LOCK_FILE
    try:
        descriptor = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # never locked (or unreadable, or a link: the trainer's own open, and the pre-launch check, report it)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return in_use_message(Path(directory))
    except OSError:
        return None
    finally:
        os.close(descriptor)  # releases the shared probe lock
    return None


class _NotOurLockFile(Exception):
    """A lock file lnstrain did not make: the message says what it is and to remove it."""


def _open_lock_file(lock_path: Path) -> int:
    """A read-write descriptor of the lock file, created new when there is none (``O_EXCL``: never a
    planted link's target). An existing one is used only if it is what a trainer leaves (its lock is
    held on that file, so it cannot be replaced while another trainer may hold it): a regular file
    of this user with one name. A symbolic link is refused (``O_NOFOLLOW``), and so is a hard link,
    whose other name may be a file outside the run that truncating and writing the holder's record
    would change."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    shown = escaped(lock_path)
    for _ in range(_TRIES):
        try:
            return os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        try:
            descriptor = os.open(lock_path, flags)
        except FileNotFoundError:
            continue  # removed in between: create it
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise _NotOurLockFile(f"{shown} is a symbolic link (to {escaped(os.readlink(lock_path))}); lnstrain never "
                                  "makes one and does not write through it: remove it") from None
        status = os.fstat(descriptor)
        problem = ("is not a regular file" if not stat.S_ISREG(status.st_mode) else
                   f"is {hard_link_detail(status.st_nlink)}" if status.st_nlink > 1 else
                   f"belongs to another user (uid {status.st_uid}), not to this trainer's (uid {os.geteuid()})"
                   if status.st_uid != os.geteuid() else None)
        if problem is None:
            return descriptor
        os.close(descriptor)
        raise _NotOurLockFile(f"{shown} {problem}; lnstrain's lock file is a regular file of the trainer's user "
                              "with no other name: remove it")
    raise _NotOurLockFile(f"{shown} appeared and disappeared {_TRIES} times while the trainer opened it: something "
                          "else is creating and removing it")


class DirectoryLock:
    """An exclusive ``flock`` on one directory's lock file, held until ``release``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.descriptor: int | None = None

    def acquire(self) -> str | None:
        """Lock; None on success (or where the file system has no locks), else why not (the in-use
        message, or a lock file that lnstrain would not have made: a link, a file with other names, a
        file of another user, anything but a regular file)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_path = self.directory / RUN_LOCK_FILE
        try:
            descriptor = _open_lock_file(lock_path)
        except _NotOurLockFile as refused:
            return str(refused)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return in_use_message(self.directory)
        except OSError as error:
            os.close(descriptor)
            if error.errno not in _NO_LOCKS:
                raise
            _unsupported(self.directory, error)
            return None
        os.ftruncate(descriptor, 0)  # the file is ours alone (_open_lock_file): nothing else is truncated
        os.pwrite(descriptor, _holder_record().encode(), 0)
        self.descriptor = descriptor
        return None

    def release(self) -> None:
        if self.descriptor is not None:
            fcntl.flock(self.descriptor, fcntl.LOCK_UN)
            os.close(self.descriptor)
            self.descriptor = None


def _agree(message: str | None, rank: int, world_size: int) -> str | None:
    """Rank 0's verdict on every rank (collective when there are several ranks)."""
    if world_size == 1:
        return message
    import torch.distributed as dist

    verdict = [message if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


@contextlib.contextmanager
def hold_run_directories(directories: Sequence[Path], rank: int, world_size: int) -> Iterator[None]:
    """Rank 0 locks every directory for the body; if another trainer holds one, every rank raises
    ``RunDirectoryInUse`` before anything is written (collective)."""
    locks: list[DirectoryLock] = []
    message = None
    if rank == 0:
        for directory in directories:
            lock = DirectoryLock(directory)
            message = lock.acquire()
            if message:
                break
            locks.append(lock)
    try:
        message = _agree(message, rank, world_size)
        if message:
            raise RunDirectoryInUse(message)
        yield
    finally:
        for lock in locks:
            lock.release()
