"""Vectorised construction of sample indices (pure functions of their inputs; no Python loop per sample).

Packed mode (GPT-style, Megatron semantics): documents are concatenated in a shuffled order, one fresh
permutation per epoch, and sample ``j`` is the ``seq_len + 1`` tokens starting at token ``j * seq_len`` of
that stream (consecutive samples share one token: the last label of one is the first input of the next).

* ``doc_order[k]``    sequence id of the k-th document of the stream
* ``sample_idx[j]``   (position in ``doc_order``, token offset) where sample ``j`` starts; row ``j + 1``
                      gives its last token, so there are ``num_samples + 1`` rows
* ``shuffle_idx[i]``  which sample is served as the i-th; shuffled within each epoch, so every document
                      is seen once before any is repeated

Truncate-pad mode: ``doc_order[i]`` is the document of sample ``i`` (a fresh permutation per epoch).

A cached index is checked against these definitions before use (``index_check``).
"""
from __future__ import annotations

import numpy as np


def _rng(seed: int, stream: int) -> np.random.RandomState:
    # RandomState's streams are frozen by numpy's compatibility policy, so indices never change with numpy;
    # separate streams for document order and sample shuffle keep each epoch's draws independent of how
    # many epochs are built (so a longer run's samples start with exactly the shorter run's samples).
    return np.random.RandomState([seed % (2**32), stream])


def _index_dtype(max_value: int):
    return np.int32 if max_value < 2**31 - 1 else np.int64


def _epoch_permutations(doc_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    doc_ids = doc_ids.astype(_index_dtype(int(doc_ids.max()) if len(doc_ids) else 0), copy=False)
    return np.concatenate([rng.permutation(doc_ids) for _ in range(num_epochs)])


def build_packed_index(sizes: np.ndarray, doc_ids: np.ndarray, seq_len: int, num_samples: int,
                       seed: int) -> dict[str, np.ndarray]:
    """Indices of ``num_samples`` packed samples of ``seq_len + 1`` tokens from documents ``doc_ids``.

    The samples served for ``num_samples = n`` are exactly the first ``n`` served for any larger count.
    """
    if seq_len <= 0 or num_samples <= 0:
        raise ValueError(f"seq_len and num_samples must be > 0 (got {seq_len}, {num_samples})")
    doc_ids = np.asarray(doc_ids)
    tokens_per_epoch = int(sizes[doc_ids].sum(dtype=np.int64)) if len(doc_ids) else 0
    if tokens_per_epoch == 0:
        raise ValueError("cannot build packed samples: the selected documents hold no tokens")
    # epochs whose samples are shuffled: the fewest whose sample starts (ceil(E*T/L)) cover num_samples
    num_epochs = (num_samples - 1) * seq_len // tokens_per_epoch + 1
    total_samples = -(-num_epochs * tokens_per_epoch // seq_len)  # every sample starting in those epochs
    needed = total_samples * seq_len + 1  # the last of them ends one window later, in the next epoch(s)
    doc_order = _epoch_permutations(doc_ids, -(-needed // tokens_per_epoch), _rng(seed, 0))
    cum = np.zeros(len(doc_order) + 1, np.int64)
    np.cumsum(sizes[doc_order], out=cum[1:])
    last_doc = int(np.searchsorted(cum, total_samples * seq_len, side="right")) - 1
    doc_order = doc_order[: last_doc + 1]
    cum = cum[: last_doc + 2]
    # number of sample starts (multiples of seq_len) inside each document: ceil(end/L) - ceil(start/L)
    starts_per_doc = np.diff(-(-cum // seq_len))
    start_doc = np.repeat(np.arange(len(doc_order), dtype=_index_dtype(len(doc_order))), starts_per_doc)
    start_doc = start_doc[: total_samples + 1]
    offsets = np.arange(total_samples + 1, dtype=np.int64) * seq_len
    offsets -= cum[start_doc]
    sample_idx = np.empty((total_samples + 1, 2), _index_dtype(max(len(doc_order), int(sizes.max()))))
    sample_idx[:, 0] = start_doc
    sample_idx[:, 1] = offsets
    # shuffle within epochs: epoch e holds the samples starting in tokens [e*T, (e+1)*T)
    bounds = -(-np.arange(num_epochs + 1, dtype=np.int64) * tokens_per_epoch // seq_len)
    sdtype, rng = _index_dtype(total_samples), _rng(seed, 1)
    shuffle_idx = np.concatenate([(rng.permutation(b - a) + a).astype(sdtype)
                                  for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())])
    return {"doc_order": doc_order, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx[:num_samples]}


def build_truncate_pad_index(doc_ids: np.ndarray, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """One document per sample: ``num_samples`` entries, one fresh permutation of ``doc_ids`` per epoch."""
    doc_ids = np.asarray(doc_ids)
    if len(doc_ids) == 0:
        raise ValueError("cannot build samples: no documents selected")
    num_epochs = -(-num_samples // len(doc_ids))
    return {"doc_order": _epoch_permutations(doc_ids, num_epochs, _rng(seed, 0))[:num_samples]}


def build_blend_index(weights: list[float], num_samples: int) -> dict[str, np.ndarray]:
    """Interleave datasets so the mix follows ``weights`` at every prefix of the run, not only on average.

    Dataset ``k``'s ``m``-th sample is due at time ``(m + 0.5) / w_k``; serving samples in order of due time
    (ties to the lower dataset index) keeps each dataset's count within about one sample of ``n * w_k`` for
    every prefix length ``n``; the blend of ``n`` samples is the prefix of any longer blend. Returns
    ``dataset_index`` and ``dataset_sample_index`` per blended sample.
    """
    w = np.asarray(weights, np.float64)
    if len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blend weights must be finite and > 0 (got {weights})")
    w = w / w.sum()
    # dataset k is never served more than n*w_k + K/2 + 1 times in n samples: candidates beyond that never win
    counts = np.ceil(num_samples * w).astype(np.int64) + len(w) + 1
    due = np.concatenate([(np.arange(c) + 0.5) / wk for c, wk in zip(counts, w)])
    owner = np.repeat(np.arange(len(w), dtype=np.int16), counts)
    rank = np.concatenate([np.arange(c) for c in counts])
    order = np.argsort(due, kind="stable")[:num_samples]
    return {"dataset_index": owner[order], "dataset_sample_index": rank[order]}

