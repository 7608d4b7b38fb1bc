"""Test hook: every moment of a checkpoint save, so tests can kill a save at each one of them.

Inert unless a test asks for it: with ``LNSTRAIN_TEST_KILL_AT_SAVE_POINT=K`` (or ``R:K``, only on
global rank R) the process SIGKILLs itself at the K-th save point it reaches (counted over all saves
of the process); with ``LNSTRAIN_TEST_PAUSE_AT_SAVE_POINT`` it stops there until killed from outside
(a scheduler preempting the job in the middle of a save); a test in the same process may instead set
``observer`` to look at the files at each point. Library code only calls ``reached(label)``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lnstrain.checkpoint.engine_hooks import replaced
from lnstrain.deepspeed_adapter import CheckpointFileIO

logger = logging.getLogger(__name__)

KILL_AT_ENV = "LNSTRAIN_TEST_KILL_AT_SAVE_POINT"
PAUSE_AT_ENV = "LNSTRAIN_TEST_PAUSE_AT_SAVE_POINT"

observer: Callable[[str, Path | None], None] | None = None
"""A test's ``fn(label, file being written or None)``, called at every save point."""
_counter = itertools.count(1)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _target(variable: str) -> int | None:
    value = os.environ.get(variable)
    if not value:
        return None
    target_rank, _, point = value.rpartition(":")
    if target_rank and int(target_rank) != _global_rank():
        return None
    return int(point)


def active() -> bool:
    return observer is not None or bool(os.environ.get(KILL_AT_ENV) or os.environ.get(PAUSE_AT_ENV))


def reached(label: str, path: Path | None = None) -> None:
    """A moment of a save; ``path`` names a file whose writing starts or ends there."""
    if not active():
        return
    if observer is not None:
        observer(label, path)
    number = next(_counter)
    if number == _target(KILL_AT_ENV):
        logger.warning("%s: killing this process at save point %d (%s)", KILL_AT_ENV, number, label)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
    if number == _target(PAUSE_AT_ENV):
        logger.warning("%s: pausing this process at save point %d (%s) until it is killed", PAUSE_AT_ENV, number,
                       label)
        while True:
            time.sleep(1)


@contextlib.contextmanager
def around_deepspeed_files(file_io: CheckpointFileIO) -> Iterator[None]:
    """Save points before and after each file DeepSpeed's ``save_checkpoint`` writes through ``file_io``
    (``TrainingEngine.checkpoint_files``), only when active."""
    if not active():
        yield
        return
    original = file_io.save

    def save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        reached("deepspeed file: before", Path(path))
        result = original(state_dict, path, *args, **kwargs)
        reached("deepspeed file: written", Path(path))
        return result

    with replaced(file_io, "save", save):
        yield
