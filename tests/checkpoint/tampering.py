"""What the integrity and safe-loading tests do to checkpoint files: plant a payload that would leave
a marker file if it ever ran, overwrite or cut bytes, and (as an attacker who knows the format
would) record a changed file's new size and hash in the completion marker."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from lnstrain.checkpoint.integrity import file_record
from lnstrain.checkpoint.metadata import COMPLETE_MARKER


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
    entry = content["files"][name]
    content["files"][name] = dataclasses.asdict(file_record(step_dir / name, entry["rank"]))
    marker.write_text(json.dumps(content))


def overwrite_middle(path: Path, size: int = 4096) -> None:
    """Overwrite ``size`` bytes in the middle of ``path`` with other bytes (what a bad disk or copy does)."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 - size // 2
    data[start:start + size] = bytes((b + 1) % 256 for b in data[start:start + size])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
