"""A study's kept depth analyses (``depth.archive``): one small JSON file per analysed checkpoint, meant
to be committed with the study, so that runs trained in different sessions or on different machines
(whose checkpoints are gone) combine in one ``collect``.

Each file records what the analysis depends on, as content hashes:

- ``settings``: the run's model, optimizer, training and precision settings that differ from their
  defaults (not paths);
- ``trained_on``: the content of its training data and tokenizer (``data.fingerprint.data_fingerprint``);
- ``trained_as``: both of the above in one hash;
- ``measured_on``: the content of the validation token files and the number of windows measured.

Where the study's data is here, an archived analysis is used only when ``trained_as`` and
``measured_on`` match what the study would compute now; otherwise it is reported as stale and the
checkpoint (if present) is analysed again, replacing it. Where the data is not here (a fresh clone), the
data hashes cannot be checked: an analysis is used when its ``settings`` match, and only if it was made
on the data most of the archive was made on, so that one report never mixes corpora. The report then
says so and names that data's hashes.

Layout: ``<archive>/<run name>/step<N>.json``. Format 1 files (no ``settings``) are used only where the
data is here, and are rewritten as format 2 when they match it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lnstrain.analysis.depth_analysis import DepthAnalysis
from lnstrain.checkpoint.metadata import write_atomically
from lnstrain.config.loader import to_dict
from lnstrain.config.run_config import Config
from lnstrain.data.fingerprint import data_fingerprint, file_fingerprint, hash_description
from lnstrain.study.spec import DepthCollection

logger = logging.getLogger(__name__)
FORMAT_VERSION = 2
WEIGHT_SHAPING_SECTIONS = ("model", "optim", "train", "precision")


def _non_default_settings(config: Config) -> dict:
    description = {}
    for name in WEIGHT_SHAPING_SECTIONS:
        section = getattr(config, name)
        values, defaults = to_dict(section), to_dict(type(section)())
        description[name] = {key: value for key, value in values.items() if defaults.get(key) != value}
    return description


@dataclass(frozen=True)
class RunHashes:
    """What decides a run's weights at a step. ``trained_on`` and ``trained_as`` are None when the run's
    data is not here."""

    settings: str
    trained_on: str | None
    trained_as: str | None


def run_hashes(config: Config) -> RunHashes:
    """The run's hashes. Only the settings that differ from their defaults enter them: a key added to
    lnstrain later, at a default that keeps what earlier versions computed, leaves an archived analysis
    usable."""
    description = _non_default_settings(config)
    settings = hash_description(description, length=32)
    try:
        trained_on = data_fingerprint(config.data)
    except OSError:
        return RunHashes(settings, None, None)
    return RunHashes(settings, trained_on[:32], hash_description({**description, "data": trained_on}, length=32))


def measured_on(depth: DepthCollection) -> str | None:
    """Hash of the validation data and sample count every checkpoint is measured with; None when the
    validation data is not here."""
    try:
        return hash_description({"data": file_fingerprint(depth.data), "num_samples": depth.num_samples}, length=32)
    except OSError:
        return None


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.warning("%s: not readable (%s); not used", path, error)
        return None
    return record if isinstance(record, dict) else None


@dataclass
class DepthArchive:
    """The archive directory and the data hashes an analysis must have been made with."""

    root: Path
    measured_on: str | None
    """This study's validation data hash, or None when the data is not here."""
    archive_data: tuple[str, str] | None = None
    """(trained_on, measured_on) most of the archive was made with: what an analysis is held to where
    this machine's data cannot say."""
    stale: list[str] = field(default_factory=list)
    """``run step N`` of each archived analysis that did not match (reported by ``collect``)."""
    read: list[str] = field(default_factory=list)
    """``run step N`` of each analysis taken from the archive (recorded by ``study.depth.run_analyses``)."""
    unchecked: list[str] = field(default_factory=list)
    """Those of ``read`` whose data could not be checked against this machine's (it is not here)."""

    def path(self, run: str, step: int) -> Path:
        return self.root / run / f"step{step}.json"

    def load(self, run: str, step: int, hashes: RunHashes) -> DepthAnalysis | None:
        """The archived analysis of ``run`` at ``step``, if there is one made from the same run and data."""
        path = self.path(run, step)
        if not path.is_file():
            return None
        record = _read(path)
        if record is None or record.get("format") not in (1, FORMAT_VERSION):
            self.stale.append(f"{run} step {step}")
            return None
        checked = hashes.trained_as is not None and self.measured_on is not None
        if checked:
            expected = {"trained_as": hashes.trained_as, "measured_on": self.measured_on}
        else:
            trained_on, measured = self.archive_data or (None, None)
            expected = {"format": FORMAT_VERSION, "settings": hashes.settings,
                        "trained_on": hashes.trained_on or trained_on, "measured_on": self.measured_on or measured}
        differing = [key for key, value in expected.items() if record.get(key) != value]
        if differing:
            logger.warning("%s: made with a different %s than this study's; not used", path, " and ".join(differing))
            self.stale.append(f"{run} step {step}")
            return None
        analysis = DepthAnalysis.from_dict(record["analysis"])
        if checked and record.get("format") != FORMAT_VERSION:
            self.store(run, step, hashes, analysis)  # the data is here to vouch for the split hashes
        if not checked:
            self.unchecked.append(f"{run} step {step}")
        return analysis

    def store(self, run: str, step: int, hashes: RunHashes, analysis: DepthAnalysis) -> None:
        if hashes.trained_as is None or self.measured_on is None:
            return  # nothing to stamp it with
        path = self.path(run, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"format": FORMAT_VERSION, "run": run, "step": step, "trained_as": hashes.trained_as,
                  "settings": hashes.settings, "trained_on": hashes.trained_on, "measured_on": self.measured_on,
                  "analysis": analysis.to_dict()}
        write_atomically(path, json.dumps(record, separators=(",", ":")) + "\n")


def majority_data(root: Path) -> tuple[str, str] | None:
    """The (trained_on, measured_on) pair most format-2 files under ``root`` record (ties: the first in
    sorted path order)."""
    pairs: Counter[tuple[str, str]] = Counter()
    for path in sorted(root.glob("*/step*.json")):
        record = _read(path)
        if record and record.get("format") == FORMAT_VERSION and record.get("trained_on") and record.get("measured_on"):
            pairs[(record["trained_on"], record["measured_on"])] += 1
    return pairs.most_common(1)[0][0] if pairs else None


def open_archive(depth: DepthCollection) -> DepthArchive | None:
    """The study's archive, or None when ``depth.archive`` is unset."""
    if not depth.archive:
        return None
    root = Path(depth.archive)
    return DepthArchive(root, measured_on(depth), majority_data(root))
