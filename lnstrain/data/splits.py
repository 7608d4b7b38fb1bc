"""Train/validation split by documents: a document is in exactly one split."""
from __future__ import annotations

import numpy as np


def split_documents(num_documents: int, valid_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid) document ids, each sorted; ``round(valid_fraction * D)`` (at least 1) random documents
    go to validation when ``valid_fraction > 0``. Depends only on (D, valid_fraction, split_seed)."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"data.valid_fraction must be in [0, 1) (got {valid_fraction})")
    if valid_fraction == 0.0:
        return np.arange(num_documents, dtype=np.int64), np.zeros(0, np.int64)
    if num_documents < 2:
        raise ValueError(f"cannot hold out validation documents from {num_documents} document(s); "
                         "set data.valid_fraction: 0 or give data.valid_sources")
    num_valid = min(max(1, round(valid_fraction * num_documents)), num_documents - 1)
    perm = np.random.RandomState(split_seed % 2**32).permutation(num_documents)
    is_valid = np.zeros(num_documents, bool)
    is_valid[perm[:num_valid]] = True
    return np.flatnonzero(~is_valid), np.flatnonzero(is_valid)


def documents_to_sequences(doc_idx: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
    """Sequence ids of documents ``doc_ids``, where document ``d`` spans sequences ``[doc_idx[d], doc_idx[d+1])``.

    Files written by lnstrain have one sequence per document; Megatron files may have several.
    """
    doc_idx = np.asarray(doc_idx)
    if len(doc_idx) - 1 == doc_idx[-1] and np.array_equal(doc_idx, np.arange(len(doc_idx))):
        return np.asarray(doc_ids, np.int64)
    starts, ends = doc_idx[doc_ids], doc_idx[np.asarray(doc_ids) + 1]
    lengths = ends - starts
    first = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - first, lengths)
