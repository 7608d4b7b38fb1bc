"""Stable content fingerprints of token files and of a whole data configuration.

A file's fingerprint hashes the complete ``.idx`` (sizes and layout of every document), the ``.bin`` size
and three 64 KiB samples of the ``.bin`` (start, middle, end). It does not depend on paths or mtimes, so
copying the data elsewhere keeps its caches valid, while re-tokenizing it changes the fingerprint.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

from .config import DataConfig
from .tokenizer import file_sha256

_SAMPLE_BYTES = 64 << 10


def file_fingerprint(prefix: str) -> str:
    """Hex fingerprint of ``<prefix>.idx``/``.bin`` (memoised per process while the files are unchanged)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: not found (create it with tools/preprocess_data.py)")
    si, sb = os.stat(idx), os.stat(bin_)
    return _fingerprint(os.path.abspath(prefix), si.st_size, si.st_mtime_ns, sb.st_size, sb.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _fingerprint(prefix: str, idx_size: int, _idx_mtime: int, bin_size: int, _bin_mtime: int) -> str:
    h = hashlib.sha256()
    h.update(file_sha256(prefix + ".idx").encode())
    h.update(str(bin_size).encode())
    with open(prefix + ".bin", "rb") as f:
        for pos in (0, max(0, bin_size // 2 - _SAMPLE_BYTES // 2), max(0, bin_size - _SAMPLE_BYTES)):
            f.seek(pos)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def hash_description(description: dict, length: int = 16) -> str:
    """Short stable hash of a JSON-serialisable description (used in cache file names)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def data_fingerprint(cfg: DataConfig) -> str:
    """Stable hash of every input file's content fingerprint plus the settings that shape the samples.

    Stored in checkpoints: a resume with a different fingerprint means the data changed under the run.
    """
    description = {
        "sources": [(file_fingerprint(s.prefix), float(s.weight)) for s in cfg.sources],
        "valid_sources": [(file_fingerprint(s.prefix), float(s.weight)) for s in cfg.valid_sources],
        "valid_fraction": cfg.valid_fraction if not cfg.valid_sources else None,
        "split_seed": cfg.split_seed,
        "seq_len": cfg.seq_len,
        "mode": cfg.mode,
        "tokenizer": file_sha256(cfg.tokenizer) if cfg.tokenizer else None,
    }
    return hash_description(description, 64)
