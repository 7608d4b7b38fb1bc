"""Weighted blend of several sample datasets whose mix follows the weights at every point of the run."""
from __future__ import annotations

import numpy as np

from .fingerprint import hash_description
from .index_cache import IndexCache
from .index_check import blend_index_problem
from .sample_index import build_blend_index


class BlendedDataset:
    """Sample ``i`` is sample ``dataset_sample_index[i]`` of ``datasets[dataset_index[i]]``."""

    def __init__(self, datasets: list, weights: list[float], index: dict[str, np.ndarray]):
        self.datasets, self.weights = datasets, [w / sum(weights) for w in weights]
        self.dataset_index, self.dataset_sample_index = index["dataset_index"], index["dataset_sample_index"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]

    @property
    def prefixes(self) -> list[str]:
        return [p for ds in self.datasets if ds is not None for p in ds.prefixes]


def blend_counts(weights: list[float], num_samples: int, cache: IndexCache, fingerprints: list[str],
                 split: str) -> tuple[dict[str, np.ndarray], list[int]]:
    """The (cached) blend index and how many samples each component must provide."""
    description = {"weights": [float(w) for w in weights], "num_samples": num_samples, "inputs": fingerprints}
    name = f"blend_{split}_{hash_description(description)}"
    index = cache.get_or_build(name, description, lambda: build_blend_index(weights, num_samples),
                               lambda arrays: blend_index_problem(arrays, weights, num_samples))
    counts = np.bincount(index["dataset_index"], minlength=len(weights))
    return index, [int(c) for c in counts]
