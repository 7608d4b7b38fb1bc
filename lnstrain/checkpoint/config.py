"""When and where checkpoints are written, and what a run resumes from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """Checkpointing.

    Attributes:
        dir: checkpoint directory; default ``<run dir>/checkpoints``.
        interval_steps: save every this many steps; 0 disables step-based saves.
        interval_minutes: also save when this many minutes passed since the last save.
        keep_last: keep only the newest N checkpoints (the one ``latest`` names is never deleted);
            unset keeps all.
        resume: ``auto`` (resume from the checkpoint directory's ``latest`` if there is one),
            ``none`` (start fresh; refuses to overwrite existing checkpoints) or a path to a run's
            checkpoint directory or one ``global_stepN`` directory.
        save_at_end: save when the run finishes.
        allow_data_mismatch: resume even if the data fingerprint or tokenizer checksum changed.
    """

    dir: str | None = None
    interval_steps: int = 1000
    interval_minutes: float | None = None
    keep_last: int | None = None
    resume: str = "auto"
    save_at_end: bool = True
    allow_data_mismatch: bool = False

    def validate(self) -> list[str]:
        problems = []
        if self.interval_steps < 0:
            problems.append(f"checkpoint.interval_steps must be >= 0 (got {self.interval_steps})")
        if self.interval_minutes is not None and self.interval_minutes <= 0:
            problems.append(f"checkpoint.interval_minutes must be > 0 (got {self.interval_minutes})")
        if self.keep_last is not None and self.keep_last < 1:
            problems.append(f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")
        return problems
