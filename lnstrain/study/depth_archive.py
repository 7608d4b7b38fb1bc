"""A study's kept depth analyses (``depth.archive``): one small JSON file per analysed checkpoint, meant
to be committed with the study, so that runs trained in different sessions or on different machines
(whose checkpoints are gone) combine in one ``collect``.

Each file records what the analysis depends on, as two content hashes:

- ``trained_as``: the run's model, optimizer, training and precision settings that differ from their
  defaults, and the content of its training data and tokenizer (``data.fingerprint.data_fingerprint``),
  not its paths;
- ``measured_on``: the content of the validation token files and the number of windows measured.

An archived analysis is used only when both match what the study would compute now; otherwise it is
reported as stale and the checkpoint (if present) is analysed again, replacing it.

Layout: ``<archive>/<run name>/step<N>.json``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from lnstrain.analysis.depth_analysis import DepthAnalysis
from lnstrain.checkpoint.metadata import write_atomically
from lnstrain.config.loader import to_dict
from lnstrain.config.run_config import Config
from lnstrain.data.fingerprint import data_fingerprint, file_fingerprint, hash_description
from lnstrain.study.spec import DepthCollection

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1
WEIGHT_SHAPING_SECTIONS = ("model", "optim", "train", "precision")


def trained_as(config: Config) -> str:
    """Hash of everything that decides a run's weights at a step, without paths.

    Only the settings that differ from their defaults enter it: a key added to lnstrain later, at a
    default that keeps what earlier versions computed, leaves an archived analysis usable."""
    description = {}
    for name in WEIGHT_SHAPING_SECTIONS:
        section = getattr(config, name)
        values, defaults = to_dict(section), to_dict(type(section)())
        description[name] = {key: value for key, value in values.items() if defaults.get(key) != value}
    description["data"] = data_fingerprint(config.data)
    return hash_description(description, length=32)


def measured_on(depth: DepthCollection) -> str:
    """Hash of the validation data and sample count every checkpoint is measured with."""
    return hash_description({"data": file_fingerprint(depth.data), "num_samples": depth.num_samples}, length=32)


@dataclass
class DepthArchive:
    """The archive directory and the hashes the study would record now."""

    root: Path
    measured_on: str
    stale: list[str] = field(default_factory=list)
    """``run step N`` of each archived analysis that did not match (reported by ``collect``)."""
    read: list[str] = field(default_factory=list)
    """``run step N`` of each analysis taken from the archive (recorded by ``study.depth.run_analyses``)."""

    def path(self, run: str, step: int) -> Path:
        return self.root / run / f"step{step}.json"

    def load(self, run: str, step: int, trained: str) -> DepthAnalysis | None:
        """The archived analysis of ``run`` at ``step``, if there is one made from the same run
        (``trained``: its ``trained_as`` hash) and data."""
        path = self.path(run, step)
        if not path.is_file():
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
        expected = {"format": FORMAT_VERSION, "trained_as": trained, "measured_on": self.measured_on}
        differing = [key for key, value in expected.items() if record.get(key) != value]
        if differing:
            logger.warning("%s: made with a different %s than this study's; not used", path, " and ".join(differing))
            self.stale.append(f"{run} step {step}")
            return None
        return DepthAnalysis.from_dict(record["analysis"])

    def store(self, run: str, step: int, trained: str, analysis: DepthAnalysis) -> None:
        path = self.path(run, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"format": FORMAT_VERSION, "run": run, "step": step, "trained_as": trained,
                  "measured_on": self.measured_on, "analysis": analysis.to_dict()}
        write_atomically(path, json.dumps(record, separators=(",", ":")) + "\n")


def open_archive(depth: DepthCollection) -> DepthArchive | None:
    """The study's archive, or None when ``depth.archive`` is unset."""
    if not depth.archive:
        return None
    return DepthArchive(Path(depth.archive), measured_on(depth))
