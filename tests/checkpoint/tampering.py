"""What the integrity and safe-loading tests do to checkpoint files: plant a payload that would leave
a marker file if it ever ran, overwrite or cut bytes, and (as an attacker who knows the format
would) record a changed file's new size and hash in the completion marker.

``train_stopped_run`` makes the run they attack (``conftest.stopped_run``): one tiny 1-rank run
stopped at step 4 with checkpoints at steps 2 and 4, signed with a key kept outside it, and the same
run uninterrupted to step 6 for its losses. ``copy_run`` gives each test its own copy to damage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from lnstrain.checkpoint.integrity import file_record
from lnstrain.checkpoint.metadata import COMPLETE_MARKER
from lnstrain.config.run_config import Config, load_config
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides

RUN = ["train.steps=6", "checkpoint.interval_steps=2", "train.eval_interval=0", "model.hidden_dropout=0.1"]
"""Dropout on, so that a resume reproduces the uninterrupted run only if the RNG states come back too."""
OPTIMIZER_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"
TOLERANCE = 1e-6
"""fp32 on one rank: a resume reproduces the uninterrupted losses up to summation order."""


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return eval, (f"__import__('pathlib').Path({str(self.marker)!r}).touch()",)


def plant(path: Path, value: object, key: str = "lnstrain_test_extra") -> None:
    """Add ``value`` under ``key`` to the dict a ``.pt`` file holds (the file is this test's own)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state[key] = value
    torch.save(state, path)


def rerecord(step_dir: Path, name: str) -> None:
    """Make the completion marker's record of ``name`` match the file as it is now."""
    marker = step_dir / COMPLETE_MARKER
    content = json.loads(marker.read_text())
    rank = content["files"].get(name, {}).get("rank", 0)
    content["files"][name] = dataclasses.asdict(file_record(step_dir / name, rank))
    marker.write_text(json.dumps(content))


def overwrite_middle(path: Path, size: int = 4096) -> None:
    """Overwrite ``size`` bytes in the middle of ``path`` with other bytes (what a bad disk or copy does)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 - size // 2
    data[start:start + size] = bytes((b + 1) % 256 for b in data[start:start + size])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bit(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def edit_metadata(step_dir: Path, **values: object) -> None:
    """Change ``lnstrain_metadata.json`` and record its new hash (a rehashed forgery)."""
    path = step_dir / "lnstrain_metadata.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | values))
    rerecord(step_dir, path.name)


# --- the run they attack --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StoppedRun:
    """``root/run``: stopped at step 4 (checkpoints 2 and 4, signed with ``key``); ``straight``: the
    uninterrupted run's losses, steps 1-6."""

    root: Path
    corpus: TinyCorpus
    key: Path
    straight: dict[int, float]

    def copy(self, name: str) -> Path:
        """A copy of the stopped run's directory, to damage: ``<root>/<name>``."""
        return copy_run(self.root, name)


def copy_run(root: Path, name: str) -> Path:
    shutil.copytree(root / "run", root / name, symlinks=True)
    return root / name


def checkpoints(run_root: Path) -> Path:
    return run_root / "tiny" / "checkpoints"


def step_dir(run_root: Path, step: int) -> Path:
    return checkpoints(run_root) / f"global_step{step}"


def run_config(corpus: TinyCorpus, run_root: Path, *extra: str, world_size: int | None = 1) -> Config:
    return load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, run_root) + RUN + list(extra), world_size)


def make_key(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(32).hex().encode() + b"\n")
    path.chmod(0o600)
    return path


def train_stopped_run(rank: int, world_size: int, corpus: TinyCorpus, root: Path, key: Path) -> dict[int, float]:
    """(distributed, 1 rank) The uninterrupted run's losses; ``root/run`` stopped at step 4, signed."""
    from lnstrain.training.trainer import pretrain

    straight = pretrain(run_config(corpus, root / "straight", world_size=world_size))
    pretrain(run_config(corpus, root / "run", f"checkpoint.signing_key_file={key}", world_size=world_size),
             stop_at_step=4)
    return straight.losses
