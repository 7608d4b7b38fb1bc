"""Checking a cached sample index: is it an index the build (``sample_index``) could have made of these inputs?

Whoever can write beside the data can rewrite a cached index (``index_cache``) as they like: repeat one
sample everywhere, point past the end of the token file. These checks hold for every index a build makes
and fail for any change that repeats, drops or misplaces a sample: each epoch serves each of its samples
once, and each sample is the ``seq_len + 1`` tokens at its place in the document stream. (A different
shuffle of the same samples within each epoch passes: it changes the order, not what is trained on.)

The check is what a launch waits for (on every node: ``check_records``), so each array is read once,
in chunks of bounded memory, with as few numpy passes as the invariant allows:

* a permutation is one scatter into a preallocated bool array and one count (no sort, no
  ``searchsorted``);
* ``sample_idx`` is checked per *run* of rows that continue one document (row ``j + 1`` is row ``j``
  moved ``seq_len`` tokens on in the same document): only the first row of a run is compared with the
  document stream and only its last row with the document's end, so the work on the stream grows with
  the documents, not the samples;
* ``shuffle_idx``'s epoch of each sample is a range check per chunk lying in one epoch;
* a blend index is checked against its definition (the ``n`` blended samples of earliest due time, in
  that order) in linear time, instead of being built again (a sort).
"""
from __future__ import annotations

import sys

import numpy as np

_CHUNK = 1 << 18  # rows per step: temporaries of about 2 MB (a core's L2 cache), whatever the index's size
_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))  # what a build writes, in this machine's byte order


def _integers(array: np.ndarray, name: str, shape: tuple) -> str | None:
    """Unless ``array`` has integers of a type a build writes, in ``shape`` (``None``: any length), why not."""
    if not isinstance(array, np.ndarray) or array.dtype not in _INDEX_DTYPES:
        return f"{name} is not an array of 32- or 64-bit integers"
    if len(array.shape) != len(shape) or any(want not in (None, got) for got, want in zip(array.shape, shape)):
        wanted = ", ".join("any" if n is None else str(n) for n in shape)
        return f"{name} has shape {array.shape}, not ({wanted}{',' if len(shape) == 1 else ''})"
    return None


def _largest_unsigned(array: np.ndarray) -> int:
    """The largest value of ``array`` read as unsigned: a negative value counts as huge, so one bound
    checks both ends of a range that starts at 0."""
    if len(array) == 0:
        return -1
    return int(array.view(f"u{array.dtype.itemsize}").max())


def epochs_problem(order: np.ndarray, doc_ids: np.ndarray, what: str) -> str | None:
    """``order`` is one permutation of ``doc_ids`` (distinct ids) per epoch, the last one possibly cut short."""
    count = len(doc_ids)
    if len(order) == 0:
        return None
    top = int(doc_ids.max())
    if _largest_unsigned(order) > top:
        return f"{what} names documents outside the split"
    slot = None  # the split holds every id up to its largest: an id is its own slot
    if count != top + 1:
        slot = np.full(top + 1, -1, np.int32 if count < 2**31 else np.int64)
        slot[doc_ids] = np.arange(count, dtype=slot.dtype)
    seen = np.zeros(-(-len(order) // count) * count, bool)  # seen[e * count + slot]: epoch e serves it
    for first in range(0, len(order), _CHUNK):
        keys = order[first:first + _CHUNK]
        if slot is not None:
            keys = slot[keys]
            if keys.min() < 0:
                return f"{what} names documents outside the split"
        epoch, last_epoch = first // count, (first + len(keys) - 1) // count
        if epoch == last_epoch:
            seen[epoch * count:(epoch + 1) * count][keys] = True
        else:
            seen[np.arange(first, first + len(keys)) // count * count + keys] = True
    if np.count_nonzero(seen) != len(order):
        return f"{what} repeats a document within an epoch"
    return None


def _document_starts(order: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Token position in the stream of each document of ``order``, and the stream's length last."""
    starts = np.zeros(len(order) + 1, np.int64)
    lengths = np.empty(min(_CHUNK, len(order)), sizes.dtype)
    for first in range(0, len(order), _CHUNK):
        part = np.take(sizes, order[first:first + _CHUNK], out=lengths[:min(_CHUNK, len(order) - first)],
                       mode="clip")  # (order is checked; "raise" would copy)
        np.cumsum(part, dtype=np.int64, out=starts[first + 1:first + 1 + len(part)])
        starts[first + 1:first + 1 + len(part)] += starts[first]
    return starts


def _run_starts(rows: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows (of ``rows``, a chunk of ``sample_idx``) that do not continue the previous row's document
    ``seq_len`` tokens on; the first row always starts a run."""
    breaks = np.empty(len(rows), bool)
    breaks[0] = True
    if rows.dtype.itemsize == 4 and rows.flags.c_contiguous and sys.byteorder == "little":
        # A row (document, offset) read as one uint64 is document + offset * 2**32, so a row continues
        # its predecessor exactly when it is larger by seq_len * 2**32 (offsets are known >= 0, < 2**31).
        packed = rows.view(np.uint64).reshape(-1)
        step = np.subtract(packed[1:], packed[:-1])
        np.not_equal(step, np.uint64(seq_len) << np.uint64(32), out=breaks[1:])
    else:
        np.not_equal(rows[1:, 0], rows[:-1, 0], out=breaks[1:])
        breaks[1:] |= (rows[1:, 1] - rows[:-1, 1]) != seq_len
    return np.flatnonzero(breaks)


def samples_problem(sample_idx: np.ndarray, starts: np.ndarray, seq_len: int) -> str | None:
    """Row ``j`` of ``sample_idx`` is (position in the document order, offset) of token ``j * seq_len`` of
    the stream whose documents begin at ``starts`` (``starts[-1]``: its length)."""
    if len(sample_idx) and int(sample_idx[:, 1].min()) < 0:
        return "sample_idx names a token outside its document"
    positions = len(starts) - 1
    for first in range(0, len(sample_idx), _CHUNK):
        rows = sample_idx[first:first + _CHUNK]
        run_first = _run_starts(rows, seq_len)
        leaders = np.take(rows, run_first, axis=0)
        documents = leaders[:, 0]
        if _largest_unsigned(documents) >= positions:
            return "sample_idx names positions outside doc_order"
        token = (run_first + first) * seq_len
        if not np.array_equal(starts[documents] + leaders[:, 1], token):
            return f"sample_idx does not start sample j at token j * {seq_len} of the document stream"
        # each run's last row still lies inside its document (the rows before it follow from the first)
        run_last = np.empty_like(run_first)
        run_last[:-1] = run_first[1:] - 1
        run_last[-1] = len(rows) - 1
        if (starts[1:][documents] <= (run_last + first) * seq_len).any():
            return "sample_idx names a token outside its document"
    return None


def shuffle_problem(shuffle_idx: np.ndarray, total_samples: int, tokens_per_epoch: int, seq_len: int) -> str | None:
    """``shuffle_idx`` serves each of the ``total_samples`` samples at most once, each within its own epoch
    (sample ``j`` belongs to the epoch of its first token, ``j * seq_len // tokens_per_epoch``)."""
    if _largest_unsigned(shuffle_idx) >= total_samples:
        return "shuffle_idx names samples that do not exist"
    seen = np.zeros(total_samples, bool)
    for first in range(0, len(shuffle_idx), _CHUNK):
        served = shuffle_idx[first:first + _CHUNK]
        epoch = first * seq_len // tokens_per_epoch
        if (first + len(served) - 1) * seq_len // tokens_per_epoch == epoch:  # the chunk lies in one epoch
            low = -(-epoch * tokens_per_epoch // seq_len)
            high = -(-(epoch + 1) * tokens_per_epoch // seq_len)
            outside = int(served.min()) < low or int(served.max()) >= high
        else:
            positions = np.arange(first, first + len(served), dtype=np.int64)
            outside = not np.array_equal(served * np.int64(seq_len) // tokens_per_epoch,
                                         positions * seq_len // tokens_per_epoch)
        if outside:
            return "shuffle_idx serves a sample outside its epoch"
        seen[served] = True
    if np.count_nonzero(seen) != len(shuffle_idx):
        return "shuffle_idx serves a sample more than once"
    return None


def packed_index_problem(index: dict[str, np.ndarray], sizes: np.ndarray, doc_ids: np.ndarray, seq_len: int,
                         num_samples: int) -> str | None:
    """Why ``index`` is not a packed index ``build_packed_index`` could have made of these inputs, or None."""
    doc_ids = np.asarray(doc_ids)
    tokens_per_epoch = int(sizes[doc_ids].sum(dtype=np.int64)) if len(doc_ids) else 0
    if tokens_per_epoch == 0 or seq_len <= 0 or num_samples <= 0:
        return "no build makes an index of these inputs (no tokens or no samples)"
    num_epochs = (num_samples - 1) * seq_len // tokens_per_epoch + 1
    total_samples = -(-num_epochs * tokens_per_epoch // seq_len)
    # the stream a build lays out ends in the epoch holding its last sample's last token
    longest_order = -(-(total_samples * seq_len + 1) // tokens_per_epoch) * len(doc_ids)
    doc_order, sample_idx, shuffle_idx = (index.get(key) for key in ("doc_order", "sample_idx", "shuffle_idx"))
    problem = (_integers(doc_order, "doc_order", (None,))
               or _integers(sample_idx, "sample_idx", (total_samples + 1, 2))
               or _integers(shuffle_idx, "shuffle_idx", (num_samples,)))
    if problem:
        return problem
    if len(doc_order) > longest_order:
        return f"doc_order has {len(doc_order)} entries; a build of these inputs makes at most {longest_order}"
    return (epochs_problem(doc_order, doc_ids, "doc_order")
            or samples_problem(sample_idx, _document_starts(doc_order, sizes), seq_len)
            or shuffle_problem(shuffle_idx, total_samples, tokens_per_epoch, seq_len))


def truncate_pad_index_problem(index: dict[str, np.ndarray], doc_ids: np.ndarray, num_samples: int) -> str | None:
    """Why ``index`` is not an index ``build_truncate_pad_index`` could have made of these inputs, or None."""
    doc_order = index.get("doc_order")
    if len(doc_ids) == 0:
        return "no build makes an index of no documents"
    return (_integers(doc_order, "doc_order", (num_samples,))
            or epochs_problem(doc_order, np.asarray(doc_ids), "doc_order"))


def blend_index_problem(index: dict[str, np.ndarray], weights: list[float], num_samples: int) -> str | None:
    """Why ``index`` is not what ``build_blend_index(weights, num_samples)`` makes, or None.

    The build serves, in order of (due time, dataset), the ``num_samples`` samples of earliest due time,
    sample ``m`` of dataset ``k`` being due at ``(m + 0.5) / w_k``. So an index is that build exactly when
    (1) its (due time, dataset) pairs rise strictly, (2) each dataset's samples are ``0, 1, ...`` with no
    gap (with (1) they rise strictly, so their sum is the least possible, ``c (c - 1) / 2`` for ``c`` of
    them, only when they are ``0 .. c - 1``), and (3) every dataset's next sample is due after the last.
    The due times are computed with the build's very floating-point operations.
    """
    w = np.asarray(weights, np.float64)
    w = w / w.sum()
    dataset, sample = index.get("dataset_index"), index.get("dataset_sample_index")
    for array, name, dtype in ((dataset, "dataset_index", np.int16), (sample, "dataset_sample_index", np.int64)):
        if not isinstance(array, np.ndarray) or array.dtype != np.dtype(dtype) or array.shape != (num_samples,):
            return f"{name} is not {num_samples} {np.dtype(dtype).name} integers"
    if _largest_unsigned(dataset) >= len(w) or _largest_unsigned(sample) >= num_samples:
        return "it names datasets or samples that do not exist"
    counts = np.zeros(len(w), np.int64)
    served_sum = 0
    last_due, last_dataset = -np.inf, -1
    for first in range(0, num_samples, _CHUNK):
        k, m = dataset[first:first + _CHUNK], sample[first:first + _CHUNK]
        due = (m + 0.5) / w[k]
        rising = np.empty(len(due), bool)
        np.greater(due[1:], due[:-1], out=rising[1:])
        rising[1:] |= (due[1:] == due[:-1]) & (k[1:] > k[:-1])
        rising[0] = due[0] > last_due or (due[0] == last_due and k[0] > last_dataset)
        if not rising.all():
            return "it does not serve samples in order of due time"
        counts += np.bincount(k, minlength=len(w))
        served_sum += int(m.sum())
        last_due, last_dataset = float(due[-1]), int(k[-1])
    if served_sum != sum(c * (c - 1) // 2 for c in counts.tolist()):
        return "it skips samples of a dataset"
    upcoming = (counts + 0.5) / w
    if np.any((upcoming < last_due) | ((upcoming == last_due) & (np.arange(len(w)) < last_dataset))):
        return "it leaves out a sample due earlier than one it serves"
    return None
