"""The ``logging.wandb`` section: whether and where a run is tracked in Weights & Biases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

WANDB_MODES = ("disabled", "online", "offline")


@dataclass
class WandbConfig:
    """Weights & Biases tracking (rank 0 only; ``pip install wandb``).

    Every scalar TensorBoard gets (training, validation, depth statistics, downstream accuracy), the
    per-layer depth profiles and the resolved config go to one W&B run per run directory; a resumed
    run continues it (``lnstrain.tracking.wandb_sink``).

    Attributes:
        mode: ``disabled`` (the default: wandb is not even imported), ``online`` (streamed to the
            W&B server: ``wandb login`` or ``WANDB_API_KEY`` first) or ``offline`` (written under
            ``<run dir>/wandb/``, or under ``WANDB_DIR`` when set, uploaded later with ``wandb sync``;
            needs no network). When tracking is on, the environment's ``WANDB_MODE`` (W&B's own
            switch, e.g. ``offline`` on compute nodes without a network) overrides online/offline.
        project: the W&B project.
        entity: the W&B user or team; unset: your default entity.
        name: the W&B run's display name; unset: ``run.name``.
        tags: tags of the W&B run.
    """

    mode: Literal["disabled", "online", "offline"] = "disabled"
    project: str = "lnstrain"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    def validate(self) -> list[str]:
        problems = []
        if self.mode not in WANDB_MODES:
            problems.append(f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)} (got {self.mode!r})")
        if self.enabled and not self.project:
            problems.append("logging.wandb.project must name a W&B project when logging.wandb.mode is "
                            f"{self.mode}")
        return problems
