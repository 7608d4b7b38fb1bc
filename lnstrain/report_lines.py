"""Lines that report what was found in a run directory: names shown escaped, findings capped per kind.

Anyone who can write a run directory chooses the names in it, the targets of its links and the text
of the files lnstrain reads there (the run lock's holder record, a marker's file list). Printed raw,
a newline in such a name forges a log line and an ANSI escape colours or clears the terminal; so
every such name goes into a message through ``escaped``, which shows control characters (and the
bytes of a name that is not UTF-8) as ``\\xNN`` escapes. And a directory can hold any number of planted
files: ``Findings`` keeps the first few lines of each kind and counts the rest, so a marker listing
500,000 files that do not exist is one line per kind plus a count, not 500,000 lines.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Callable, Iterable

SHOWN_PER_KIND = 5
"""Lines of one kind of finding shown before the rest are counted."""


def _escape_character(character: str) -> str:
    code = ord(character)
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a name that is not UTF-8 (os.fsdecode's surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escaped(name: str | os.PathLike | bytes) -> str:
    """``name`` with every character that could act on a terminal or a log shown as an escape:
    control and format characters (newline, ESC, bidirectional overrides, ...), unassigned ones and
    undecodable bytes, and the backslash that starts an escape. Printable text, non-ASCII letters
    included, is unchanged."""
    text = os.fsdecode(name) if isinstance(name, bytes) else os.fspath(name) if isinstance(name, os.PathLike) else name
    if text.isprintable() and "\\" not in text:
        return text  # the common case, quickly
    return "".join(_escape_character(c) if c == "\\" or unicodedata.category(c)[0] in "CZ" and c != " " else c
                   for c in text)


class Findings:
    """Lines found while checking something, each of a kind (a few words: ``files missing``); at most
    ``limit`` lines of a kind are kept, the others counted, and a line found twice is kept once."""

    def __init__(self, limit: int = SHOWN_PER_KIND) -> None:
        self.limit = limit
        self.kept: list[tuple[str, str]] = []
        self.more: dict[str, int] = {}

    def add(self, kind: str, line: str | Callable[[], str]) -> None:
        """Keep ``line`` (or what calling it gives: made only when it is kept) or count it."""
        if sum(1 for kept_kind, _ in self.kept if kept_kind == kind) >= self.limit:
            self.more[kind] = self.more.get(kind, 0) + 1
            return
        line = line() if callable(line) else line
        if (kind, line) not in self.kept:
            self.kept.append((kind, line))

    def extend(self, kind: str, lines: Iterable[str]) -> None:
        for line in lines:
            self.add(kind, line)

    def merge(self, other: "Findings", same_things: bool = False) -> None:
        """Add another check's findings (a line both found is kept once). ``same_things``: both
        looked at the same things (every rank lists the same directory), so the larger count of lines
        not kept is right, not their sum (each rank looked at its own share)."""
        for kind, line in other.kept:
            self.add(kind, line)
        for kind, count in other.more.items():
            self.more[kind] = max(self.more.get(kind, 0), count) if same_things else self.more.get(kind, 0) + count

    def __bool__(self) -> bool:
        return bool(self.kept)

    def __repr__(self) -> str:
        return f"Findings({self.lines!r})"

    @property
    def lines(self) -> list[str]:
        """The kept lines, each kind's followed by ``... and N more <kind>`` when some were not kept."""
        lines: list[str] = []
        for kind in dict.fromkeys(kind for kind, _ in self.kept):
            lines += [line for line_kind, line in self.kept if line_kind == kind]
            if self.more.get(kind):
                lines.append(f"... and {self.more[kind]:,} more {kind}")
        return lines


def capped(lines: list[str], kind: str, limit: int = SHOWN_PER_KIND) -> list[str]:
    """The first ``limit`` of ``lines``, then one line counting the rest."""
    if len(lines) <= limit:
        return list(lines)
    return lines[:limit] + [f"... and {len(lines) - limit:,} more {kind}"]
