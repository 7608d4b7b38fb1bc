"""The Weights & Biases sink: one W&B run per run directory, continued when the run resumes.

``<run dir>/wandb_run.json`` (``run_files.WANDB_RUN_FILE``) keeps what a later process needs:

    id                    the W&B run id (a resumed trainer and tools/evaluate.py continue it)
    logged_through_step   the highest training step already logged
    next_row              W&B's own step for the next row

W&B's own step is a row counter here, not lnstrain's step. Every row carries lnstrain's step in the
field ``step``, declared as the x-axis of every metric (``define_metric``), and the tokens seen in
``tokens``. So the evaluation of an older checkpoint (``tools/evaluate.py``) can be recorded at that
checkpoint's step after later steps were logged, which W&B's monotonic step cannot place; and an
offline run continued by several processes has increasing row numbers, so ``wandb sync`` uploads
its pieces in order.

A trainer resumed from a checkpoint replays the steps between that checkpoint and where the last
launch ended; those rows are already in W&B and are not logged again. The record is written before a
row is sent, so a crash between the two leaves a gap in W&B's row numbers, never a row sent twice.
A run started from step 0 in a directory that has a record starts a new W&B run (it trains the same
steps again; mixing them into the old W&B run would log steps twice).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lnstrain.no_follow import write_text_replacing
from lnstrain.run_files import WANDB_RUN_FILE
from lnstrain.tracking.config import WandbConfig
from lnstrain.tracking.sinks import MetricSink

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install wandb (or pip install 'lnstrain[wandb]')"
STEP_FIELD = "step"
TOKENS_FIELD = "tokens"


def import_wandb(mode: str) -> Any:
    """The wandb module, or ImportError saying how to install it or switch it off."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"logging.wandb.mode is {mode} but wandb is not installed: {INSTALL_HINT}, "
                          "or set logging.wandb.mode: disabled") from e
    return wandb


def wandb_problems(settings: WandbConfig) -> list[str]:
    """wandb must be importable when tracking is on (checked before launch: rank 0 would fail alone)."""
    if settings.enabled and importlib.util.find_spec("wandb") is None:
        return [f"logging.wandb.mode is {settings.mode} but wandb is not installed: {INSTALL_HINT}, "
                "or set logging.wandb.mode: disabled"]
    return []


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The run directory's W&B record, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads((run_dir / WANDB_RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return None
    return record


def _write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Replace the record by rename (no fsync: losing its last update costs a row number, nothing else)."""
    write_text_replacing(run_dir / WANDB_RUN_FILE, json.dumps(record) + "\n")  # a link there is replaced


def new_run_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbSink(MetricSink):
    """Logs to the W&B run of ``run_dir`` (see the module docstring).

    Args:
        continue_run: continue the run directory's W&B run when it has one (a resumed trainer, a
            tool); False starts a new one (a trainer starting at step 0).
        skip_logged_steps: never log a step twice: not the steps up to the record's
            ``logged_through_step`` (a resumed trainer's replay), nor, after a rollback, a tag at a
            step at or below the highest step this process logged that tag at. A tag's first row
            below the highest step logged is kept: the downstream evaluation of a checkpoint written
            in the background (``checkpoint.async_save``) arrives after later training steps. False
            logs every call.
        config: the resolved run config, stored as the W&B run's config.
    """

    name = "W&B"

    def __init__(self, settings: WandbConfig, run_dir: Path, run_name: str, config: Mapping[str, Any] | None,
                 continue_run: bool, skip_logged_steps: bool = True) -> None:
        wandb = import_wandb(settings.mode)
        self.wandb = wandb
        self.run_dir = Path(run_dir)
        record = read_record(self.run_dir)
        if record is not None and not continue_run:
            logger.warning("starting a new W&B run: training starts at step 0, so the W&B run %s recorded in %s "
                           "is not continued", record["id"], self.run_dir / WANDB_RUN_FILE)
            record = None
        self.record = record or {"id": new_run_id(), "logged_through_step": -1, "next_row": 0}
        self.replayed_through = self.record["logged_through_step"] if skip_logged_steps else None
        """Steps up to this one are in the W&B run already (a resumed trainer replays them)."""
        directory = None if os.environ.get("WANDB_DIR") else str(self.run_dir)
        mode = os.environ.get("WANDB_MODE") or settings.mode  # W&B's own switch wins, as it does for W&B
        self.run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_name,
                              id=self.record["id"], resume="allow", mode=mode, dir=directory,
                              tags=list(settings.tags) or None)
        if config is not None:
            self.run.config.update(dict(config), allow_val_change=True)
        self.run.define_metric(STEP_FIELD)
        self.run.define_metric(TOKENS_FIELD, step_metric=STEP_FIELD)
        self.run.define_metric("*", step_metric=STEP_FIELD)
        _write_record(self.run_dir, self.record)
        logger.info("W&B run %s (%s, project %s)%s", self.record["id"], mode, settings.project,
                    " continued" if record else "")
        self._skipped: list[int] = []
        self._highest_step_of_tag: dict[str, int] = {}
        """The highest step this process logged each tag at: the tag at that step or below is a replay."""

    def _send(self, row: dict[str, Any], step: int) -> None:
        if self.replayed_through is not None:
            tags = set(row) - {TOKENS_FIELD}
            if step <= self.replayed_through or any(self._highest_step_of_tag.get(tag, -1) >= step for tag in tags):
                if not self._skipped or self._skipped[-1] != step:
                    self._skipped.append(step)
                return
            self._highest_step_of_tag.update(dict.fromkeys(tags, step))
        number = self.record["next_row"]
        self.record["next_row"] = number + 1
        self.record["logged_through_step"] = max(self.record["logged_through_step"], step)
        _write_record(self.run_dir, self.record)
        self.run.log({**row, STEP_FIELD: step}, step=number)

    def log_scalars(self, scalars: Mapping[str, float], step: int, tokens: int | None = None) -> None:
        row: dict[str, Any] = dict(scalars)
        if tokens is not None:
            row[TOKENS_FIELD] = tokens
        self._send(row, step)

    def log_layer_profiles(self, profiles: Mapping[str, Sequence[float]], step: int) -> None:
        if not profiles:
            return
        histograms = {}
        for tag, values in profiles.items():
            edges = [number + 0.5 for number in range(len(values) + 1)]
            histograms[tag] = self.wandb.Histogram(np_histogram=(list(values), edges))
        self._send(histograms, step)

    def close(self) -> None:
        if self.run is None:
            return
        if self._skipped:
            logger.info("W&B: %d step(s) between %d and %d were logged before and not logged again",
                        len(self._skipped), min(self._skipped), max(self._skipped))
        self.run.finish()
        self.run = None
