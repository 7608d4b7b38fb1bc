"""A checkpoint save fails on every rank or on none, so no rank waits for one that gave up.

A save has three phases, each ending in one collective that every rank reaches whatever happened:
rank 0 prepares the step directory; every rank writes its files (DeepSpeed's shards, the RNG file,
rank 0's metadata) and fsyncs them; rank 0 publishes the checkpoint (completion marker, ``latest``,
retention). An exception inside a phase is held, not raised: inside DeepSpeed's ``save_checkpoint``
the failing rank skips its remaining files but still reaches DeepSpeed's own barriers. At the phase's
end every rank learns of every failure, and every rank raises: ``CheckpointWriteError`` with the same
message when the failures are write failures (no space, no permission), else the failing rank
re-raises its own exception and the others say which rank failed.

Without this, a rank whose disk is full leaves the others waiting in a collective until its timeout
(30 minutes by default), and the message that explains it is one line among thousands.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lnstrain.checkpoint.engine_hooks import replaced
from lnstrain.checkpoint.write_errors import CheckpointWriteError, describe_write_failure, is_write_failure

if TYPE_CHECKING:
    from lnstrain.deepspeed_adapter import CheckpointFileIO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankFailure:
    """What one rank reports of its failed phase: picklable, for ``all_gather_object``."""

    rank: int
    is_write_failure: bool
    text: str


class HeldFailure:
    """The first exception raised in a phase on this rank, kept until every rank can hear of it."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def hold(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            logger.debug("held until every rank knows of it", exc_info=error)

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Hold what the block raises (callers skip blocks once a failure is held)."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - every rank hears of it at the phase's end
            self.hold(error)

    def report(self, rank: int, step_dir: Path, previous: Path | None) -> RankFailure | None:
        if self.error is None:
            return None
        if is_write_failure(self.error):
            return RankFailure(rank, True, describe_write_failure(self.error, step_dir, previous))
        return RankFailure(rank, False, f"{type(self.error).__name__}: {self.error}")


@contextlib.contextmanager
def holding_deepspeed_failures(checkpoint_files: CheckpointFileIO, held: HeldFailure) -> Iterator[None]:
    """Inside DeepSpeed's ``save_checkpoint``: a file that fails to write (through ``checkpoint_files``,
    ``TrainingEngine.checkpoint_files``) is held in ``held``, and this rank writes no further files,
    but it goes on through DeepSpeed's collectives with the others."""
    original: Callable[..., Any] = checkpoint_files.save

    def save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        if held.error is not None:
            return None
        try:
            return original(state_dict, path, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - raised on every rank once all have left DeepSpeed
            held.hold(error)
            return None

    with replaced(checkpoint_files, "save", save):
        yield


def raise_if_any_failed(reports: list[RankFailure | None], held: HeldFailure, world_size: int) -> None:
    """Raise on every rank when any rank's ``reports`` entry is a failure (``held`` is this rank's)."""
    failed = [report for report in reports if report is not None]
    if not failed:
        return
    if held.error is not None and not is_write_failure(held.error):
        raise held.error
    first = failed[0]
    if not first.is_write_failure:
        raise RuntimeError(f"rank {first.rank} failed while saving a checkpoint ({first.text}); its log has the "
                           "traceback. The previous checkpoint is untouched.")
    message = first.text
    if world_size > 1:
        message = f"rank {first.rank} of {world_size}: {message}"
        if len(failed) > 1:
            others = [str(report.rank) for report in failed[1:]]
            message += f" {'Ranks' if len(others) > 1 else 'Rank'} {', '.join(others)} also failed."
    raise CheckpointWriteError(message, agreed=True)
