"""Writer and merger of Megatron-format token files; outputs appear only when complete (temp name + rename)."""
from __future__ import annotations

import logging
import os
import shutil
from typing import Iterable

import numpy as np

from lnstrain.no_follow import create_exclusively

from .indexed_dataset import HEADER_BYTES, MAGIC, VERSION, IndexedDataset, dtype_code

logger = logging.getLogger(__name__)


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


def write_index(path: str, dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write an ``.idx`` file (not atomically; callers write to a temp name)."""
    sizes = np.asarray(sizes, np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes), np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, np.int64)
    with os.fdopen(create_exclusively(path), "wb") as f:  # a new file: never a link planted beside the data
        f.write(MAGIC)
        f.write(np.uint64(VERSION).tobytes())
        f.write(np.uint8(dtype_code(dtype)).tobytes())
        f.write(np.uint64(len(sizes)).tobytes())
        f.write(np.uint64(len(doc_idx)).tobytes())
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())
    assert os.path.getsize(path) == HEADER_BYTES + 12 * len(sizes) + 8 * len(doc_idx)


class IndexedDatasetWriter:
    """Streams documents into ``<prefix>.bin.tmp-*``; ``finalize()`` writes the index and renames both.

    Use as a context manager: on an exception the temp files are deleted and no output appears.
    Each document is one sequence (so the document index is 0..N).
    """

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin_tmp = _tmp_name(prefix + ".bin")
        self._idx_tmp = _tmp_name(prefix + ".idx")
        self._bin = os.fdopen(create_exclusively(self._bin_tmp), "wb")
        self._sizes: list[np.ndarray] = []
        self.num_tokens = 0

    def add_document(self, tokens) -> None:
        self.add_documents(np.asarray(tokens), np.array([len(tokens)], np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents whose tokens are concatenated in ``tokens``."""
        if tokens.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            if len(tokens) and (tokens.min() < info.min or tokens.max() > info.max):
                raise ValueError(f"{self.prefix}: token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype}")
            tokens = tokens.astype(self.dtype)
        self._bin.write(tokens.tobytes())
        self._sizes.append(np.asarray(lengths, np.int32))
        self.num_tokens += len(tokens)

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        write_index(self._idx_tmp, self.dtype, sizes, np.arange(len(sizes) + 1, dtype=np.int64))
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")
        logger.info("wrote %s.{bin,idx}: %d documents, %d tokens", self.prefix, len(sizes), self.num_tokens)

    def abort(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def merge_datasets(prefixes: Iterable[str], output_prefix: str) -> IndexedDataset:
    """Concatenate several token files (same dtype) into one, keeping their document boundaries."""
    parts = [IndexedDataset(p) for p in prefixes]
    if not parts:
        raise ValueError("merge_datasets: no input prefixes given")
    dtypes = {str(p.dtype) for p in parts}
    if len(dtypes) > 1:
        raise ValueError("cannot merge token files of different dtypes: "
                         + ", ".join(f"{p.prefix} ({p.dtype})" for p in parts))
    if any(os.path.abspath(p.prefix) == os.path.abspath(output_prefix) for p in parts):
        raise ValueError(f"merge output {output_prefix} is also an input")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    bin_tmp, idx_tmp = _tmp_name(output_prefix + ".bin"), _tmp_name(output_prefix + ".idx")
    try:
        with os.fdopen(create_exclusively(bin_tmp), "wb") as out:
            for p in parts:
                with open(p.bin_path, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        sizes = np.concatenate([p.sizes for p in parts])
        doc_parts, offset = [np.zeros(1, np.int64)], 0
        for p in parts:
            doc_parts.append(p.doc_idx[1:] + offset)
            offset += len(p)
        write_index(idx_tmp, parts[0].dtype, sizes, np.concatenate(doc_parts))
        os.replace(bin_tmp, output_prefix + ".bin")
        os.replace(idx_tmp, output_prefix + ".idx")
    except BaseException:
        for path in (bin_tmp, idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        raise
    return IndexedDataset(output_prefix)
