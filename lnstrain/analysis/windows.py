"""The windows an analysis measured on, recorded with it, and whether two analyses share them.

An analysis is measured on `count` windows of `seq_len + 1` consecutive tokens, cut from the start
of a token stream (a token file, or text tokenized by the model's tokenizer). Its `WindowRecord`
says which: length, count (and how many were asked for), where the first window starts, the source
and its checksum, the tokenizer and its checksum, and a checksum of the windows' token ids.

Two analyses are measured on the same windows when their token ids are the same: the same length,
count, start and token checksum. Everything else that differs (source, tokenizer) is said beside,
because it says why the tokens differ: the same text read by two tokenizers gives two sets of windows,
whose losses are per token of different tokenizations.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lnstrain.data.tokenizer import file_sha256

SAME_WINDOWS = ("seq_len", "count", "start", "tokens_sha256")
"""The fields two analyses on the same windows share."""
_EXPLAINING = ("source_sha256", "tokenizer_sha256")
_TITLES = {"seq_len": "window length", "count": "number of windows", "start": "first token",
           "tokens_sha256": "token-id checksum", "source_sha256": "source checksum", "tokenizer_sha256": "tokenizer checksum"}


@dataclass(frozen=True)
class WindowRecord:
    seq_len: int
    """Tokens predicted per window (a window holds seq_len + 1 tokens)."""
    count: int
    requested: int
    """Windows asked for; `count` is fewer when the source ran out."""
    start: int
    """Offset of the first window's first token in the token stream (the tool always starts at 0)."""
    source: str
    """The text file(s) or token-file prefix, as given."""
    source_kind: str
    """"text" or "token file"."""
    source_sha256: str
    tokenizer: str
    """Which tokenizer made the ids ("not recorded" for a token file without --data-tokenizer)."""
    tokenizer_sha256: str | None
    tokens_sha256: str
    """SHA-256 of the windows' ids (int64, little-endian, window after window)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WindowRecord:
        return cls(**data)

    def describe(self) -> str:
        """One line: "54 windows (of 64 asked) of 2048 + 1 tokens from valid.jsonl"."""
        asked = f" (of {self.requested} asked)" if self.count < self.requested else ""
        return f"{self.count} windows{asked} of {self.seq_len} + 1 tokens from {self.source}"


def tokens_checksum(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def sources_checksum(paths: Sequence[str]) -> str:
    """One SHA-256 over the files' contents, in order (one file: that file's own SHA-256)."""
    digests = [file_sha256(path) for path in paths]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _value(record: WindowRecord, field: str) -> str:
    value = getattr(record, field)
    if field.endswith("sha256"):
        shown = "none" if value is None else value[:12]
        detail = {"source_sha256": record.source, "tokenizer_sha256": record.tokenizer}.get(field)
        return f"{shown} ({detail})" if detail else shown
    return str(value)


def window_differences(runs: Sequence[tuple[str, WindowRecord | None]]) -> list[str]:
    """Empty when every run was measured on the same windows; else one line per way they differ
    (runs without a record first), each giving every run's value."""
    missing = [name for name, record in runs if record is None]
    if missing:
        return [f"{', '.join(missing)} record{'s' if len(missing) == 1 else ''} no windows (made before the windows "
                "were recorded): re-run the analysis to record them"]
    records = [(name, record) for name, record in runs if record is not None]
    if len({tuple(getattr(r, field) for field in SAME_WINDOWS) for _, r in records}) <= 1:
        return []
    lines = []
    for field in SAME_WINDOWS + _EXPLAINING:
        values = [(name, _value(record, field)) for name, record in records]
        if len({value for _, value in values}) > 1:
            lines.append(f"{_TITLES[field]} differs: " + "; ".join(f"{name} {value}" for name, value in values))
    return lines
