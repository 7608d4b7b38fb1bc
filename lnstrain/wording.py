"""How lnstrain's messages put a number and a noun together: "1 micro-batch", "2 micro-batches"."""

from __future__ import annotations


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """``count`` and the noun in the number it takes (``plural`` defaults to ``singular`` + "s", or
    + "es" after s, x, z, ch and sh)."""
    if count == 1:
        return f"{count} {singular}"
    if plural is None:
        plural = singular + ("es" if singular.endswith(("s", "x", "z", "ch", "sh")) else "s")
    return f"{count:,} {plural}"
