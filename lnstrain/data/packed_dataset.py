"""Sample datasets over one token file: packed windows or truncate-and-pad documents.

Both return ``{"tokens": int64[seq_len + 1], "loss_mask": float32[seq_len]}`` per sample, where
``loss_mask[t]`` says whether the prediction of ``tokens[t + 1]`` from ``tokens[: t + 1]`` counts.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from .fingerprint import file_fingerprint, hash_description
from .index_cache import IndexCache
from .indexed_dataset import IndexedDataset
from .index_check import packed_index_problem, truncate_pad_index_problem
from .sample_index import build_packed_index, build_truncate_pad_index

INDEX_VERSION = 1


class PackedDataset:
    """GPT-style samples of ``seq_len + 1`` consecutive tokens across document boundaries (all loss counts)."""

    def __init__(self, indexed: IndexedDataset, index: dict[str, np.ndarray], seq_len: int):
        self.indexed, self.seq_len = indexed, seq_len
        self.doc_order, self.sample_idx, self.shuffle_idx = index["doc_order"], index["sample_idx"], index["shuffle_idx"]
        self._ones = np.ones(seq_len, np.float32)

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def tokens(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        j = self.shuffle_idx[i]
        (d0, o0), (d1, o1) = self.sample_idx[j], self.sample_idx[j + 1]
        ds, order = self.indexed, self.doc_order
        if d0 == d1:
            return ds.get(order[d0], o0, o1 - o0 + 1).astype(np.int64)
        parts = [ds.get(order[d0], o0)]
        parts += [ds[order[d]] for d in range(d0 + 1, d1)]
        parts.append(ds.get(order[d1], 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens(i), "loss_mask": self._ones.copy()}

    @property
    def prefixes(self) -> list[str]:
        return [self.indexed.prefix]


class TruncatePadDataset:
    """One document per sample, cut to ``seq_len + 1`` tokens and padded; padding is masked out of the loss."""

    def __init__(self, indexed: IndexedDataset, index: dict[str, np.ndarray], seq_len: int, pad_id: int):
        self.indexed, self.seq_len, self.pad_id = indexed, seq_len, pad_id
        self.doc_order = index["doc_order"]

    def __len__(self) -> int:
        return len(self.doc_order)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        doc = self.indexed[self.doc_order[i]][: self.seq_len + 1]
        tokens = np.full(self.seq_len + 1, self.pad_id, np.int64)
        tokens[: len(doc)] = doc
        loss_mask = np.zeros(self.seq_len, np.float32)
        loss_mask[: max(len(doc) - 1, 0)] = 1.0
        return {"tokens": tokens, "loss_mask": loss_mask}

    @property
    def prefixes(self) -> list[str]:
        return [self.indexed.prefix]


def build_sample_dataset(indexed: IndexedDataset, doc_ids: np.ndarray, *, mode: str, seq_len: int,
                         num_samples: int, seed: int, cache: IndexCache, pad_id: int = 0,
                         split: str = "train") -> PackedDataset | TruncatePadDataset:
    """A cached sample dataset over sequences ``doc_ids`` of ``indexed``.

    The cache entry's name hashes (file fingerprint, selected documents, mode, seq_len, num_samples, seed),
    so any change of input or setting builds a new index rather than reusing a stale one.
    """
    description = {
        "version": INDEX_VERSION, "mode": mode, "fingerprint": file_fingerprint(indexed.prefix),
        "documents": hashlib.sha256(np.ascontiguousarray(doc_ids, np.int64).tobytes()).hexdigest(),
        "seq_len": seq_len, "num_samples": num_samples, "seed": seed,
    }
    name = f"{os.path.basename(indexed.prefix)}_{split}_{mode}_{hash_description(description)}"
    if mode not in ("packed", "truncate_pad"):
        raise ValueError(f"data.mode must be 'packed' or 'truncate_pad' (got {mode!r})")
    try:
        if mode == "packed":
            index = cache.get_or_build(
                name, description, lambda: build_packed_index(indexed.sizes, doc_ids, seq_len, num_samples, seed),
                lambda arrays: packed_index_problem(arrays, indexed.sizes, doc_ids, seq_len, num_samples))
            return PackedDataset(indexed, index, seq_len)
        index = cache.get_or_build(name, description, lambda: build_truncate_pad_index(doc_ids, num_samples, seed),
                                   lambda arrays: truncate_pad_index_problem(arrays, doc_ids, num_samples))
        return TruncatePadDataset(indexed, index, seq_len, pad_id)
    except ValueError as e:
        raise ValueError(f"{indexed.prefix} ({split} split, {len(doc_ids)} sequences): {e}") from e
