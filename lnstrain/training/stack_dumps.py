"""Where each rank is: the Python stack of every thread, written to the rank's stderr.

* A fatal signal (a segfault in a kernel library, an abort) writes them before the process dies.
* SIGUSR2 writes them and training goes on: ``kill -USR2 <pid>`` on a node, ``pkill -USR2 -f
  launch/pretrain.py`` for every rank there, ``scancel --signal=USR2 <job>`` on SLURM.
* ``train.stack_dump_after_minutes``: an iteration of the training loop (the step, and the evaluation
  and save that follow it) that has taken this long writes them, and again each time as long again
  passes, until the next iteration starts. Set it below ``train.collective_timeout_minutes`` so that a
  hang shows which rank waits where before the timeout ends the job.

Python's ``faulthandler`` does the writing, from C, so it works while the interpreter is stuck in a
collective or holds the GIL in a kernel call.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import signal
import sys
import threading
from typing import TextIO

logger = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR2


class StackDumps:
    """Installs the three triggers for the length of a run (``install``/``uninstall``, which restores
    what was there); ``iteration_started`` re-arms the slow-iteration timer."""

    def __init__(self, after_minutes: float | None, stream: TextIO | None = None) -> None:
        self.after_s = None if after_minutes is None else 60.0 * after_minutes
        self.stream = stream
        self._enabled_here = False
        self._registered = False
        self._armed = False

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
        if threading.current_thread() is threading.main_thread():  # signals can only be set up there
            faulthandler.register(DUMP_SIGNAL, file=stream, all_threads=True, chain=False)
            self._registered = True
            timed = "" if self.after_s is None else f", and after {self.after_s / 60:g} minutes in one loop iteration"
            logger.info("each rank writes every thread's Python stack to its stderr on SIGUSR2 (kill -USR2 %d for "
                        "this one)%s", os.getpid(), timed)
        return self

    def iteration_started(self) -> None:
        if self.after_s is not None:
            faulthandler.dump_traceback_later(self.after_s, repeat=True, file=self.stream)
            self._armed = True

    def uninstall(self) -> None:
        if self._armed:
            faulthandler.cancel_dump_traceback_later()
            self._armed = False
        if self._registered:
            faulthandler.unregister(DUMP_SIGNAL)
            self._registered = False
        if self._enabled_here:
            faulthandler.disable()
            self._enabled_here = False
