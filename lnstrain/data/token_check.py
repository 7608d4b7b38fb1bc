"""Check that every token id in the data fits the model's vocabulary, cheaply (max id cached per file)."""
from __future__ import annotations

import json
import logging
import os

from .fingerprint import file_fingerprint
from .indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)
_CHUNK = 1 << 26


def token_id_range(prefix: str) -> tuple[int, int]:
    """(min, max) token id of ``<prefix>.bin``; cached in ``<prefix>.idx.lnstrain-range.json`` when writable."""
    cache_path = prefix + ".idx.lnstrain-range.json"
    fp = file_fingerprint(prefix)
    try:
        with open(cache_path) as f:
            cached = json.load(f)
        if cached.get("fingerprint") == fp:
            return int(cached["min"]), int(cached["max"])
    except (OSError, ValueError, KeyError):
        pass
    logger.info("reading %s.bin for its smallest and largest token id (once: cached in %s)", prefix, cache_path)
    tokens = IndexedDataset(prefix).token_array()
    lo, hi = 0, -1
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start:start + _CHUNK]
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    try:
        tmp = f"{cache_path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"fingerprint": fp, "min": lo, "max": hi}, f)
        os.replace(tmp, cache_path)
    except OSError as e:
        logger.debug("cannot cache token range of %s: %s", prefix, e)
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
    """Raise ValueError naming the file and the offending id if any token is outside ``[0, vocab_size)``."""
    for prefix in _prefixes(datasets_or_prefixes):
        bad = out_of_range_id(prefix, vocab_size)
        if bad is not None:
            raise ValueError(f"{prefix}.bin holds token id {bad}, outside the model's vocabulary [0, {vocab_size}); "
                             "the data was tokenized with a different tokenizer than the model's vocab_size "
                             "(re-run tools/preprocess_data.py or fix model.vocab_size)")
