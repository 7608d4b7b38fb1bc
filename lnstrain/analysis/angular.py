"""Angular distance between residual-stream states (Gromov et al.; the LNS paper's similarity view).

d(x, y) = arccos(cos(x, y)) / pi per token, in [0, 1], averaged over tokens. Computed in float64:
in float32 two identical vectors can give cos = 1 - 6e-8 and a spurious distance of 1e-4.
"""

from __future__ import annotations

import math

import torch


def angular_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token angular distance of [..., hidden] tensors: shape [...]."""
    cos = torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=-1, eps=1e-30)
    return torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi


def pairwise_angular_distance(states: list[torch.Tensor], chunk_elements: int = 2**27) -> torch.Tensor:
    """Sum over tokens of the distance between every pair of states: [R, R] float64, and R = len(states).

    states: R tensors [batch, seq, hidden] (the same tokens at different depths). Tokens are taken in
    chunks of at most `chunk_elements` float64 values across all states (1 GiB by default), so that a
    large model's L + 1 states are never all copied to float64 at once.
    """
    flat = [s.reshape(-1, s.shape[-1]) for s in states]
    tokens, hidden = flat[0].shape
    step = max(1, chunk_elements // (len(flat) * hidden))
    total = torch.zeros(len(flat), len(flat), dtype=torch.float64, device=flat[0].device)
    for start in range(0, tokens, step):
        stacked = torch.stack([f[start:start + step] for f in flat]).double()  # [R, T, H]
        unit = stacked / stacked.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        cos = torch.einsum("rth,qth->rqt", unit, unit).clamp(-1.0, 1.0)
        total += (torch.arccos(cos) / math.pi).sum(dim=-1)
    return total


class AngularDistanceAccumulator:
    """Token-averaged angular distance between all pairs of the L + 1 residual-stream states."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.tokens = 0

    def update(self, states: list[torch.Tensor]) -> None:
        sums = pairwise_angular_distance(states)
        self.total = sums if self.total is None else self.total + sums
        self.tokens += states[0].numel() // states[0].shape[-1]

    def matrix(self) -> torch.Tensor:
        """[L + 1, L + 1]: entry (i, j) is the mean distance between states i and j."""
        if self.total is None:
            raise ValueError("no batches seen")
        return self.total / self.tokens


def distance_by_offset(matrix: torch.Tensor) -> list[list[float | None]]:
    """The heat map: row n - 1 (n = 1..L), column l - 1 (l = 1..L) holds the distance between
    the states entering layer l and layer l + n ("entering layer L + 1" = after the last layer);
    None where l + n > L + 1."""
    size = matrix.shape[0]
    num_layers = size - 1
    return [[float(matrix[l - 1, l - 1 + n]) if l + n <= size else None for l in range(1, num_layers + 1)]
            for n in range(1, num_layers + 1)]
