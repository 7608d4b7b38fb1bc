"""Where each rank is: the Python stack of every thread, written to the rank's stderr.

* A fatal signal (a segfault in a kernel library, an abort) writes them before the process dies.
* SIGUSR2 writes them and training goes on: ``kill -USR2 <pid>`` on a node, ``pkill -USR2 -f
  launch/pretrain.py`` for every rank there, ``scancel --signal=USR2 <job>`` on SLURM.
* ``train.stack_dump_after_minutes``: an iteration of the training loop (the step, and the evaluation
  and save that follow it) that has taken this long writes them, and again each time as long again
  passes, until the next iteration starts. Set it below ``train.collective_timeout_minutes`` so that a
  hang shows which rank waits where before the timeout ends the job.

The first two use Python's ``faulthandler``, which writes from C inside the signal handler, so they
work while the interpreter is stuck in a collective or holds the GIL in a kernel call. The timed dumps
do not: ``faulthandler.dump_traceback_later`` reads the other threads' frames from a thread that holds
no GIL, and crashes the process when a thread starts or ends meanwhile (the background checkpoint
writer does, every save). A watch thread takes the GIL and reads ``sys._current_frames()`` instead; a
rank waiting in a collective, in a data read or on a lock has released the GIL, so it still writes.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TextIO

import torch.distributed as dist

logger = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR2
WATCH_THREAD_NAME = "lnstrain-slow-iteration-watch"


def every_thread_stack(skip_ident: int | None = None) -> str:
    """The Python stack of each thread of this process, most recent call last, named as
    ``threading`` names them."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        parts.append(f"Thread {names.get(ident, '(not started by threading)')} ({ident:#x}), most recent call last:\n")
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)


def where_the_ranks_are() -> str:
    """Each rank's PID by host, in rank order (a collective when the job is distributed: every rank
    calls it), so that one line in rank 0's log says what to signal."""
    here = (socket.gethostname(), os.getpid())
    if not (dist.is_available() and dist.is_initialized()):
        return f"this process: pid {here[1]} on {here[0]}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, here)
    by_host: dict[str, list[str]] = {}
    for rank, (host, pid) in enumerate(everyone):
        by_host.setdefault(host, []).append(f"{rank}:{pid}")
    return "rank:pid " + "; ".join(f"on {host} {' '.join(pids)}" for host, pids in by_host.items())


class _SlowIterationWatch:
    """A daemon thread that logs every thread's stack once an iteration has run ``after_s`` seconds,
    and again each ``after_s`` after that, until ``rearm`` says the next iteration started.

    ``clock`` is ``time.monotonic`` in use; a test gives its own and calls ``look`` after moving it."""

    def __init__(self, after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self._clock = clock
        self._changed = threading.Condition()
        self._iteration: tuple[int | None, float] | None = None  # (step, when it started)
        self._next_dump_at: float | None = None
        self._closed = False
        self._looks = 0
        """How often the watch has found nothing due: a ``look`` waits for the next one."""
        self._thread = threading.Thread(target=self._watch, name=WATCH_THREAD_NAME, daemon=True)
        self._thread.start()

    def rearm(self, step: int | None) -> None:
        now = self._clock()
        with self._changed:
            self._iteration = (step, now)
            self._next_dump_at = now + self.after_s
            self._changed.notify_all()

    def look(self, timeout_s: float = 60.0) -> None:
        """Wake the watch and return once it has written every dump due at the clock's time."""
        with self._changed:
            looks = self._looks
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._looks > looks or self._closed, timeout_s)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _watch(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (self._next_dump_at is None or self._clock() < self._next_dump_at):
                    self._looks += 1
                    self._changed.notify_all()
                    wait_s = None if self._next_dump_at is None else self._next_dump_at - self._clock()
                    self._changed.wait(wait_s)
                if self._closed:
                    return
                step, started = self._iteration
                self._next_dump_at += self.after_s
            where = "this loop iteration" if step is None else f"the loop iteration of step {step}"
            logger.warning("%s has run for %.2f min (train.stack_dump_after_minutes %g); the Python stack of "
                           "every thread (pid %d):\n%s", where, (self._clock() - started) / 60, self.after_s / 60,
                           os.getpid(), every_thread_stack(skip_ident=threading.get_ident()))


class StackDumps:
    """Installs the three triggers for the length of a run (``install``/``uninstall``, which restores
    what was there); ``iteration_started`` re-arms the slow-iteration watch."""

    def __init__(self, after_minutes: float | None, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = None if after_minutes is None else 60.0 * after_minutes
        self.stream = stream
        self.clock = clock
        self._enabled_here = False
        self._registered = False
        self._watch: _SlowIterationWatch | None = None

    def install(self) -> "StackDumps":
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            stream.fileno()
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            stream = sys.__stderr__  # a captured stderr (pytest's capsys) has no descriptor
        self.stream = stream
        if not faulthandler.is_enabled():  # an earlier enable (pytest's, python -X faulthandler) stays
            faulthandler.enable(file=stream, all_threads=True)
            self._enabled_here = True
        ranks = where_the_ranks_are()  # a collective: before any branch
        if threading.current_thread() is threading.main_thread():  # signals can only be set up there
            faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
            self._registered = True
            timed = "" if self.after_s is None else f", and after {self.after_s / 60:g} minutes in one loop iteration"
            logger.info("each rank writes every thread's Python stack to its stderr on SIGUSR2 (kill -USR2 <pid>; "
                        "%s)%s", ranks, timed)
        if self.after_s is not None:
            self._watch = _SlowIterationWatch(self.after_s, self.clock)
        return self

    def iteration_started(self, step: int | None = None) -> None:
        if self._watch is not None:
            self._watch.rearm(step)

    def uninstall(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._registered:
            faulthandler.unregister(DUMP_SIGNAL)
            self._registered = False
        if self._enabled_here:
            faulthandler.disable()
            self._enabled_here = False
