"""The check of a cached sample index against an independent reference that tests every row one by one:
its shortcuts (runs of rows in one document, chunks lying in one epoch, packed rows) must accept and
refuse exactly what the row-by-row definition does, at every chunk size and both integer widths. A blend
index, checked without being built again, must pass exactly when it equals the build."""
from __future__ import annotations

import numpy as np
import pytest

from lnstrain.data import index_check
from lnstrain.data.index_check import blend_index_problem, packed_index_problem, truncate_pad_index_problem
from lnstrain.data.sample_index import build_blend_index, build_packed_index, build_truncate_pad_index


def reference_valid(index: dict, sizes: np.ndarray, doc_ids: np.ndarray, seq_len: int, num_samples: int) -> bool:
    """The definition, row by row (docs/data.md, "Index cache"), in plain Python."""
    order, rows, shuffle = (index[key] for key in ("doc_order", "sample_idx", "shuffle_idx"))
    if any(a.dtype not in (np.int32, np.int64) or not a.dtype.isnative for a in (order, rows, shuffle)):
        return False
    per_epoch, count = int(sizes[doc_ids].sum()), len(doc_ids)
    epochs = (num_samples - 1) * seq_len // per_epoch + 1
    total = -(-epochs * per_epoch // seq_len)
    if (order.ndim != 1 or rows.shape != (total + 1, 2) or shuffle.shape != (num_samples,)
            or len(order) > -(-(total * seq_len + 1) // per_epoch) * count):
        return False
    order, wanted = order.tolist(), sorted(doc_ids.tolist())
    for start in range(0, len(order), count):
        epoch = order[start:start + count]
        if len(set(epoch)) != len(epoch) or not set(epoch) <= set(wanted):
            return False
    stream_doc, stream_offset = [], []  # document position and offset of every token of the stream
    for position, doc in enumerate(order):
        stream_doc += [position] * int(sizes[doc])
        stream_offset += list(range(int(sizes[doc])))
    for j, (doc, offset) in enumerate(rows.tolist()):
        if j * seq_len >= len(stream_doc) or (doc, offset) != (stream_doc[j * seq_len], stream_offset[j * seq_len]):
            return False
    served = shuffle.tolist()
    return len(set(served)) == len(served) and all(
        0 <= s < total and s * seq_len // per_epoch == i * seq_len // per_epoch for i, s in enumerate(served))


def edits(index: dict, doc_ids: np.ndarray, seq_len: int, rng: np.random.Generator):
    """(what, edited index) pairs: small changes an attacker or a damaged disk could make."""
    order, rows, shuffle = index["doc_order"], index["sample_idx"], index["shuffle_idx"]
    i, j = rng.integers(0, len(shuffle), 2)
    r = int(rng.integers(1, len(rows)))
    d = int(rng.integers(0, len(order)))
    changed = []

    def edit(what, key, change):
        array = index[key].copy()
        changed.append((what, {**index, key: change(array)}))

    edit("one sample served twice", "shuffle_idx", lambda a: (a.__setitem__(i, a[j]), a)[1])
    edit("two samples swapped", "shuffle_idx", lambda a: (a.__setitem__([i, j], a[[j, i]]), a)[1])
    edit("a sample past the end", "shuffle_idx", lambda a: (a.__setitem__(i, len(rows) - 1), a)[1])
    edit("a negative sample", "shuffle_idx", lambda a: (a.__setitem__(i, -1), a)[1])
    edit("a row continued in its document", "sample_idx",
         lambda a: (a.__setitem__(r, a[r - 1] + [0, seq_len]), a)[1])
    edit("a run moved one token", "sample_idx", lambda a: (a.__setitem__(slice(r, None), a[r:] + [0, 1]), a)[1])
    edit("a row moved to the next document", "sample_idx", lambda a: (a.__setitem__(r, [a[r, 0] + 1, 0]), a)[1])
    edit("a negative offset", "sample_idx", lambda a: (a.__setitem__(r, [a[r, 0], -1]), a)[1])
    edit("a row past doc_order", "sample_idx", lambda a: (a.__setitem__(r, [len(order) + 2, 0]), a)[1])
    edit("a row before doc_order", "sample_idx", lambda a: (a.__setitem__(r, [-1, a[r, 1]]), a)[1])
    middle = np.flatnonzero((rows[1:-1, 0] == rows[:-2, 0]) & (rows[1:-1, 0] == rows[2:, 0])) + 1
    if len(middle):  # a row inside a run of one document, moved one token
        m = int(middle[0])
        edit("a row inside a run moved", "sample_idx", lambda a: (a.__setitem__(m, a[m] + [0, 1]), a)[1])
    last_epoch = order[len(order) // len(doc_ids) * len(doc_ids):]
    completed = np.concatenate([order, np.setdiff1d(doc_ids, last_epoch), np.tile(doc_ids, 3)]).astype(order.dtype)
    edit("more epochs than a build lays out", "doc_order", lambda a: completed)
    first_rows = np.flatnonzero((rows[1:, 0] != rows[:-1, 0]) & (rows[1:, 1] < seq_len)) + 1
    if len(first_rows):  # a row placed before its document's start, that the next row continues
        f = int(first_rows[0])
        edit("a row before its document", "sample_idx", lambda a: (a.__setitem__(f - 1, a[f] - [0, seq_len]), a)[1])
    edit("a document repeated", "doc_order", lambda a: (a.__setitem__(d, a[d - 1]), a)[1])
    edit("two documents swapped", "doc_order", lambda a: (a.__setitem__([0, d], a[[d, 0]]), a)[1])
    edit("a document outside the split", "doc_order", lambda a: (a.__setitem__(d, a.max() + 1), a)[1])
    edit("one document more", "doc_order", lambda a: np.append(a, a[:1]))
    edit("64-bit rows", "sample_idx", lambda a: a.astype(np.int64))
    edit("rows in Fortran order", "sample_idx", lambda a: np.asfortranarray(a))
    edit("big-endian rows", "sample_idx", lambda a: a.astype(a.dtype.newbyteorder()))
    return changed


@pytest.mark.parametrize("chunk", [3, 1 << 18])
def test_the_packed_check_refuses_exactly_what_the_row_by_row_definition_refuses(monkeypatch, chunk):
    monkeypatch.setattr(index_check, "_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    refused = accepted = 0
    for case in range(40):
        sizes = rng.integers(0, 12, 20).astype(np.int32)  # empty documents included
        doc_ids = np.arange(20) if case % 2 else np.sort(rng.choice(20, 11, replace=False))
        sizes[doc_ids[0]] += 1
        seq_len, num_samples = int(rng.integers(1, 9)), int(rng.integers(1, 70))
        built = build_packed_index(sizes, doc_ids, seq_len, num_samples, seed=case)
        assert packed_index_problem(built, sizes, doc_ids, seq_len, num_samples) is None
        wide = {**built, "sample_idx": built["sample_idx"].astype(np.int64)}  # checked column by column
        for what, edited in edits(built, doc_ids, seq_len, rng) + edits(wide, doc_ids, seq_len, rng):
            problem = packed_index_problem(edited, sizes, doc_ids, seq_len, num_samples)
            valid = reference_valid(edited, sizes, doc_ids, seq_len, num_samples)
            assert (problem is None) == valid, (what, problem, case)
            refused += problem is not None
            accepted += problem is None
    assert refused > 800 and accepted > 150  # both outcomes are exercised (a swap within an epoch passes)


@pytest.mark.parametrize("chunk", [2, 1 << 18])
def test_the_truncate_pad_check_wants_one_permutation_of_the_split_per_epoch(monkeypatch, chunk):
    monkeypatch.setattr(index_check, "_CHUNK", chunk)
    doc_ids = np.array([1, 4, 5, 9, 12])
    built = build_truncate_pad_index(doc_ids, 13, seed=3)
    assert truncate_pad_index_problem(built, doc_ids, 13) is None
    order = built["doc_order"]
    swapped = order.copy()
    swapped[[0, 6]] = swapped[[6, 0]]  # the same documents overall, but each epoch has one twice
    assert order[0] != order[6]
    for edited, why in [(swapped, "repeats a document within an epoch"),
                        (np.where(order == 4, 3, order), "outside the split"),
                        (order.astype(np.float64), "not an array of 32- or 64-bit integers"),
                        (order[:-1], "has shape (12,), not (13,)")]:
        problem = truncate_pad_index_problem({"doc_order": edited}, doc_ids, 13)
        assert problem is not None and why in problem, problem


@pytest.mark.parametrize("chunk", [3, 1 << 18])
def test_the_blend_check_passes_exactly_the_build(monkeypatch, chunk):
    monkeypatch.setattr(index_check, "_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    refused = 0
    for case in range(60):
        sources = int(rng.integers(1, 6))
        weights = (rng.integers(1, 4, sources) if case % 3 == 0 else rng.random(sources) + 0.01).tolist()
        n = int(rng.integers(1, 300))
        built = build_blend_index(weights, n)
        assert blend_index_problem(built, weights, n) is None, (weights, n)
        longer = build_blend_index(weights, n + 1)
        i, j = rng.integers(0, n, 2)
        candidates = [{key: longer[key][1:] for key in longer},  # shifted by one: every check but the last passes
                      {key: built[key].astype(np.int32) for key in built}]
        for key in built:
            for change in (lambda a: a.__setitem__([i, j], a[[j, i]]), lambda a: a.__setitem__(i, a[i] + 1),
                           lambda a: a.__setitem__(i, -1), lambda a: a.__setitem__(i, a[j])):
                edited = {**built, key: built[key].copy()}
                change(edited[key])
                candidates.append(edited)
        for edited in candidates:
            same = all(edited[k].dtype == built[k].dtype and np.array_equal(edited[k], built[k]) for k in built)
            problem = blend_index_problem(edited, weights, n)
            assert (problem is None) == same, (weights, n, problem)
            refused += problem is not None
    assert refused > 400
    # equal weights: both datasets' first samples are due at once, and the build serves dataset 0 first
    tie = {"dataset_index": np.array([1], np.int16), "dataset_sample_index": np.array([0], np.int64)}
    assert "leaves out a sample due earlier" in blend_index_problem(tie, [1.0, 1.0], 1)
