"""One log line per finished pass of a long analysis, with the time elapsed and an ETA."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lnstrain.training.metrics import format_duration

logger = logging.getLogger(__name__)


class Progress:
    """Counts `total` passes of equal cost; `done(what)` logs "name: pass 3/34 (what), 0:00:12 elapsed, ETA 0:02:04"."""

    def __init__(self, name: str, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.total = total
        self.finished = 0
        self._clock = clock
        self._start = clock()

    def done(self, what: str) -> None:
        self.finished += 1
        elapsed = self._clock() - self._start
        remaining = elapsed / self.finished * (self.total - self.finished)
        logger.info("%s: pass %d/%d (%s), %s elapsed, ETA %s", self.name, self.finished, self.total, what,
                    format_duration(elapsed), format_duration(remaining))
