"""What a corpus reader left out: records skipped, counted by reason, with the first example of each."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SkipCounts:
    """Records skipped for each reason, with the first few examples for the report."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, example: str = "", n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        if example and reason not in self.examples:
            self.examples[reason] = example

    def merge(self, other: "SkipCounts") -> None:
        for reason, n in other.counts.items():
            self.add(reason, other.examples.get(reason, ""), n)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self) -> str:
        if not self.counts:
            return "nothing skipped"
        return "; ".join(f"{n} {reason}" + (f" (e.g. {self.examples[reason]})" if reason in self.examples else "")
                         for reason, n in sorted(self.counts.items()))
