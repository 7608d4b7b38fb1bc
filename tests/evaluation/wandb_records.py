"""What an offline W&B run recorded, read back from its ``run-<id>.wandb`` files (no network, no wandb API).

The file is W&B's LevelDB-style log: a 7-byte header (``:W&B``, a 2-byte magic, a version byte), then
32 KiB blocks of chunks, each a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last)
and its bytes; a block's tail shorter than a header is padding. Each record is a
``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        if length == 0 and kind == 0:  # zero padding to the block's end
            position += left
            continue
        pending += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@dataclass
class OfflineRun:
    """Everything the offline pieces of one W&B run logged, in the order they were written."""

    ids: set[str] = field(default_factory=set)
    rows: list[dict] = field(default_factory=list)
    """History rows: {key: value} (values decoded from JSON), with W&B's own ``_step``."""
    config: dict = field(default_factory=dict)

    def values(self, key: str) -> list[tuple[int, object]]:
        """(lnstrain step, value) of every row that has ``key``."""
        return [(row["step"], row[key]) for row in self.rows if key in row]


def read_offline_runs(wandb_dir: Path, rows: int | None = None, timeout_s: float = 60.0) -> OfflineRun:
    """All ``offline-run-*`` directories under ``wandb_dir``, in start order (their names sort by time).

    ``rows``: wait until this many history rows are on disk. ``wandb.finish`` can return before W&B's
    service process has written a run's last records (seen on a busy machine), so a process that
    reads its own run right after finishing it may have to wait for them.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        run = _read(wandb_dir)
        if rows is None or len(run.rows) >= rows or time.monotonic() > deadline:
            return run
        time.sleep(0.2)


def _read(wandb_dir: Path) -> OfflineRun:
    run = OfflineRun()
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.ids.add(record.run.run_id)
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            elif kind == "history":
                run.rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
                continue
            else:
                continue
            run.config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates})
    return run
