"""Replacing one method of a DeepSpeed engine's ``checkpoint_engine`` for the duration of a save or load.

DeepSpeed writes and reads every checkpoint file through its engine's ``checkpoint_engine.save``/``.load``
(``TrainingEngine.checkpoint_files``);
lnstrain hashes what is written (``integrity``), loads safely (``safe_load``) and, in tests, stops at
save points (``save_points``) by replacing those methods on the instance. Replacements nest: each
restores what it replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lnstrain.deepspeed_adapter import CheckpointFileIO


@contextlib.contextmanager
def replaced(file_io: CheckpointFileIO, method: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``file_io.<method>`` is ``replacement`` inside the block, what it was after it."""
    previous = file_io.__dict__.get(method)  # an enclosing replacement, if any
    setattr(file_io, method, replacement)
    try:
        yield
    finally:
        if previous is None:
            delattr(file_io, method)  # back to the class's method
        else:
            setattr(file_io, method, previous)
