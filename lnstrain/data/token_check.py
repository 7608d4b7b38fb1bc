"""Check that every token id in the data fits the model's vocabulary: every id, at every launch,
cheaply.

The smallest and largest id of a ``.bin`` are found by reading all of it (``numpy`` max over 64 M-token
chunks: docs/data.md, "Token ids", gives the speed) and cached beside the ``.idx``
(``<prefix>.idx.lnstrain-range.json``), keyed by both files' size, inode, modification *and change*
time (``st_ctime``, which the kernel sets on every write and nobody can set back) and by their
content fingerprint. Any write to either file, in place or not, so makes the next launch scan again;
the cache only saves the scan of files that did not change. Whoever can write the cache file beside
the data can still lie in it: ``iterate_micro_batches(..., vocab_size=)`` checks every batch's ids
before it reaches the model as well (``TokenIdError``).
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np

from lnstrain.no_follow import read_regular_file, write_text_replacing

from .fingerprint import file_fingerprint
from .indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)
_CHUNK = 1 << 26
_CACHE_VERSION = 2
_CACHE_SUFFIX = ".idx.lnstrain-range.json"


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary; the message names the file and what to do."""


def _file_state(path: str) -> dict[str, int]:
    status = os.stat(path)
    return {"size": status.st_size, "inode": status.st_ino, "device": status.st_dev,
            "mtime_ns": status.st_mtime_ns, "ctime_ns": status.st_ctime_ns}


def _cache_key(prefix: str) -> dict:
    return {"version": _CACHE_VERSION, "bin": _file_state(prefix + ".bin"), "idx": _file_state(prefix + ".idx"),
            "fingerprint": file_fingerprint(prefix)}


def scan_token_range(tokens: np.ndarray) -> tuple[int, int]:
    """(min, max) of ``tokens`` read chunk by chunk (an unsigned dtype's minimum is not scanned: 0 or more)."""
    lo, hi = 0, -1
    signed = np.issubdtype(tokens.dtype, np.signedinteger)
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start:start + _CHUNK]
        hi = max(hi, int(chunk.max()))
        if signed:
            lo = min(lo, int(chunk.min()))
    return lo, hi


def token_id_range(prefix: str) -> tuple[int, int]:
    """(min, max) token id of ``<prefix>.bin``, from the cache beside it when neither file changed since
    it was written, else scanned (and cached, when the directory is writable)."""
    cache_path = prefix + _CACHE_SUFFIX
    key = _cache_key(prefix)
    try:
        cached = json.loads(read_regular_file(cache_path, 1 << 16))
        if isinstance(cached, dict) and cached.get("key") == key:
            return int(cached["min"]), int(cached["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    logger.info("reading %s.bin for its smallest and largest token id (cached in %s until the file changes)",
                prefix, cache_path)
    lo, hi = scan_token_range(IndexedDataset(prefix).token_array())
    try:
        write_text_replacing(cache_path, json.dumps({"key": key, "min": lo, "max": hi}) + "\n")
    except OSError as error:
        logger.warning("cannot cache the token range of %s (%s): every launch reads the whole file", prefix,
                       error.strerror or error)
    return lo, hi


def _prefixes(items) -> list[str]:
    out: list[str] = []
    for item in items if isinstance(items, (list, tuple)) else [items]:
        if item is None:
            continue
        if isinstance(item, str):
            out.append(item)
        elif hasattr(item, "prefixes"):
            out.extend(item.prefixes)
        else:
            raise TypeError(f"check_token_ids: expected prefixes or datasets, got {type(item).__name__}")
    return list(dict.fromkeys(out))


def out_of_range_id(prefix: str, vocab_size: int) -> int | None:
    """A token id of ``<prefix>.bin`` outside ``[0, vocab_size)`` (the smallest or the largest), or None."""
    lo, hi = token_id_range(prefix)
    if lo < 0:
        return lo
    return hi if hi >= vocab_size else None


def check_token_ids(datasets_or_prefixes, vocab_size: int) -> None:
    """Raise ``TokenIdError`` naming the file and the offending id if any token is outside ``[0, vocab_size)``."""
    for prefix in _prefixes(datasets_or_prefixes):
        bad = out_of_range_id(prefix, vocab_size)
        if bad is not None:
            raise TokenIdError(f"{prefix}.bin holds token id {bad}, outside the model's vocabulary [0, {vocab_size}); "
                               "the data was tokenized with a different tokenizer than the model's vocab_size, or "
                               "the file is damaged (re-run tools/preprocess_data.py or fix model.vocab_size)")
