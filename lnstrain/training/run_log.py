"""Where a trainer's messages go: the console, which may go away, and the run's own log file, which stays.

A console can vanish under a running trainer: ``... | tee train.log`` and a Ctrl-C kill ``tee`` with the
same keystroke, so every later write to the pipe fails (EPIPE; Python ignores SIGPIPE), or the disk of
a redirected stdout fills up (ENOSPC). Neither may cost the run its ending: ``guard_console`` wraps
``sys.stdout`` and ``sys.stderr`` so that the first failed write points that descriptor at
``/dev/null`` (later writes, C libraries' included, and the interpreter's last flush then succeed) and
the run goes on to save and exit 75 as it would have. What the console lost is in the run's own log,
``<run dir>/lnstrain.log`` (``RUN_LOG_FILE``), which rank 0 appends to from the start of every launch:
every line rank 0's console shows, and the stop, resume and failure lines (``RunLog.tell``).
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

from lnstrain.no_follow import open_for_appending
from lnstrain.report_lines import escaped
from lnstrain.run_files import RUN_LOG_FILE

LOG_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


class GuardedStream:
    """A text stream whose writes never raise for a console that went away (see the module docstring)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost: str | None = None
        """Why the console went away (``os.strerror`` of the failed write), once it did."""

    def _went_away(self, error: OSError) -> None:
        if self.lost is None:
            self.lost = os.strerror(error.errno) if error.errno else str(error)
            try:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, self._stream.fileno())
                os.close(null)
                self._stream.flush()  # what was buffered goes to /dev/null now
            except (OSError, ValueError):
                pass

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._went_away(error)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._went_away(error)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_console() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in ``GuardedStream``s (once; before any logging is set up)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, GuardedStream):
            setattr(sys, name, GuardedStream(stream))


def console_lost() -> str | None:
    """Why stdout or stderr went away during this process, or None while both are there."""
    reasons = [stream.lost for stream in (sys.stdout, sys.stderr) if isinstance(stream, GuardedStream) and stream.lost]
    return reasons[0] if reasons else None


class _RunLogHandler(logging.FileHandler):
    """The run log's handler: a file that cannot be written is said once, on the console, then left. It
    is opened without following a link (``no_follow.open_for_appending``): a link planted at its name
    is refused, never written through."""

    def _open(self):  # noqa: ANN202 (logging.FileHandler's own hook)
        return os.fdopen(open_for_appending(self.baseFilename), "a", encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS):
            sys.stderr.write(f"lnstrain: cannot write {self.baseFilename} ({os.strerror(error.errno)}); its "
                             "lines go to the console only from now on\n")
            logging.getLogger().removeHandler(self)
            return
        super().handleError(record)


class RunLog:
    """Rank 0's ``<run dir>/lnstrain.log``; other ranks keep to the console (``path`` None)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._handler: logging.Handler | None = None
        self._loss_noted = False

    def open(self, run_dir: Path, rank: int, command: str) -> None:
        """Append this launch's lines to ``run_dir``'s log from now on (rank 0 only), creating the run
        directory: it is called once the pre-launch check has passed, which creates nothing."""
        if rank != 0:
            return
        self.path = Path(run_dir) / RUN_LOG_FILE
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            handler = _RunLogHandler(self.path, mode="a", encoding="utf-8", delay=False)
        except OSError as error:
            self.tell(f"lnstrain: cannot open {escaped(self.path)} ({error.strerror or error}); this launch's lines go to the "
                      "console only")
            self.path = None
            return
        handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank), datefmt="%Y-%m-%d %H:%M:%S"))
        logging.getLogger().addHandler(handler)
        self._handler = handler
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self._file_only(f"=== {started}: {command} (pid {os.getpid()})")

    def tell(self, message: str) -> None:
        """One message for the user: on stderr in a single write (the DeepSpeed launcher runs ranks with
        ``python -u``, where ``print`` writes the text and its newline separately and another process's
        line could land between them), and in the run log."""
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
        self._note_a_lost_console()
        self._file_only(message)

    def _note_a_lost_console(self) -> None:
        lost = console_lost()
        if lost is not None and not self._loss_noted:
            self._loss_noted = True
            self._file_only(f"lnstrain: the console went away during this launch ({lost}); the lines after that "
                            "are only in this file")

    def _file_only(self, message: str) -> None:
        if self._handler is not None:
            try:
                self._handler.acquire()
                try:
                    self._handler.stream.write(f"{message}\n")
                    self._handler.flush()
                finally:
                    self._handler.release()
            except OSError:
                pass

    def close(self) -> None:
        """Note a console that went away, then stop writing the file."""
        self._note_a_lost_console()
        if self._handler is not None:
            logging.getLogger().removeHandler(self._handler)
            self._handler.close()
            self._handler = None
