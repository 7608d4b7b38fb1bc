"""Layer-wise output variance of the residual stream (the LNS paper's Figure 1).

The variance of layer l's output is taken over all its elements (tokens x hidden), the same
definition the in-training collector uses (`depth_stats.py`).
"""

from __future__ import annotations

import torch


class VarianceAccumulator:
    """Variance of each of the L + 1 residual-stream states, accumulated over batches in float64."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None
        self.elements = 0

    def update(self, states: list[torch.Tensor]) -> None:
        sums = torch.stack([s.double().sum() for s in states])
        squares = torch.stack([s.double().pow(2).sum() for s in states])
        self.sums = sums if self.sums is None else self.sums + sums
        self.squares = squares if self.squares is None else self.squares + squares
        self.elements += states[0].numel()

    def variances(self) -> list[float]:
        """[embedding output, output of layer 1, ..., output of layer L]."""
        if self.sums is None:
            raise ValueError("no batches seen")
        mean = self.sums / self.elements
        return (self.squares / self.elements - mean * mean).clamp_min(0.0).tolist()
