"""Replacing one method of a DeepSpeed engine's ``checkpoint_engine`` for the duration of a save or load.

DeepSpeed writes and reads every checkpoint file through ``engine.checkpoint_engine.save``/``.load``;
lnstrain hashes what is written (``integrity``), loads safely (``safe_load``) and, in tests, stops at
save points (``save_points``) by replacing those methods on the instance. Replacements nest: each
restores what it replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def replaced(checkpoint_engine: Any, method: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``checkpoint_engine.<method>`` is ``replacement`` inside the block, what it was after it."""
    previous = checkpoint_engine.__dict__.get(method)  # an enclosing replacement, if any
    setattr(checkpoint_engine, method, replacement)
    try:
        yield
    finally:
        if previous is None:
            delattr(checkpoint_engine, method)  # back to the class's method
        else:
            setattr(checkpoint_engine, method, previous)
