"""Reader of Megatron-LM's indexed token format (docs/data.md, "The on-disk format").

``<prefix>.idx`` layout (little endian)::

    magic     9 bytes   b"MMIDIDX\\x00\\x00"
    version   uint64    1
    dtype     uint8     Megatron code (DTYPE_CODES)
    N         uint64    number of sequences
    D         uint64    length of the document index (number of documents + 1)
    sizes     int32  x N   tokens per sequence
    pointers  int64  x N   byte offset of each sequence in <prefix>.bin
    doc_idx   int64  x D   sequence index where each document starts; 0 first, N last

``<prefix>.bin`` holds the tokens of all sequences back to back.
"""
from __future__ import annotations

import logging
import os

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
TOKEN_DTYPES = (np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16)


class CorruptDatasetError(ValueError):
    """An ``.idx``/``.bin`` pair that is truncated, corrupt or inconsistent; the message names the file."""


def dtype_code(dtype) -> int:
    """Megatron's code for a numpy dtype."""
    for code, dt in DTYPE_CODES.items():
        if np.dtype(dt) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} has no Megatron indexed-dataset code")


def token_dtype_for_vocab(vocab_size: int) -> type:
    """uint16 when every id fits comfortably (vocab < 65,500, Megatron's rule), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDataset:
    """Memory-mapped, zero-copy view of ``<prefix>.bin``/``.idx``; validated on open.

    ``ds[i]`` is a read-only numpy view of sequence ``i``; ``ds.get(i, offset, length)`` a slice of it.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_path = prefix + ".idx"
        self.bin_path = prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: not found (create it with tools/preprocess_data.py)")
        self._read_index()
        self._map_bin()

    def _fail(self, path: str, what: str) -> None:
        raise CorruptDatasetError(f"{path}: {what}")

    def _read_index(self) -> None:
        path = self.idx_path
        idx_len = os.path.getsize(path)
        if idx_len < HEADER_BYTES:
            self._fail(path, f"only {idx_len} bytes, shorter than the {HEADER_BYTES}-byte header (truncated?)")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:len(MAGIC)] != MAGIC:
            self._fail(path, f"bad magic {header[:len(MAGIC)]!r}, expected {MAGIC!r} (not a Megatron .idx file)")
        version = int(np.frombuffer(header, np.uint64, 1, 9)[0])
        code = header[17]
        n = int(np.frombuffer(header, np.uint64, 1, 18)[0])
        d = int(np.frombuffer(header, np.uint64, 1, 26)[0])
        if version != VERSION:
            self._fail(path, f"unsupported version {version} (expected {VERSION})")
        if code not in DTYPE_CODES or DTYPE_CODES[code] not in TOKEN_DTYPES:
            self._fail(path, f"unsupported dtype code {code} (token codes: 1-5, 8)")
        expected = HEADER_BYTES + 12 * n + 8 * d
        if idx_len != expected:
            self._fail(path, f"{idx_len} bytes, but the header's counts (sequences={n}, document index={d}) "
                             f"need exactly {expected} (truncated or corrupt)")
        if d < 1:
            self._fail(path, "document index is empty (it must start at 0 and end at the sequence count)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        mm = np.memmap(path, np.uint8, mode="r")
        self.sizes = np.frombuffer(mm, np.int32, n, HEADER_BYTES)
        self.pointers = np.frombuffer(mm, np.int64, n, HEADER_BYTES + 4 * n)
        self.doc_idx = np.frombuffer(mm, np.int64, d, HEADER_BYTES + 12 * n)
        self._check_index(n)

    def _check_index(self, n: int) -> None:
        path, sizes, ptrs, docs = self.idx_path, self.sizes, self.pointers, self.doc_idx
        if docs[0] != 0 or docs[-1] != n:
            self._fail(path, f"document index must start at 0 and end at {n} (got {docs[0]} .. {docs[-1]})")
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            self._fail(path, "document index is not non-decreasing")
        if n and sizes.min() < 0:
            self._fail(path, f"negative sequence size at sequence {int(np.argmin(sizes))}")
        nbytes = sizes.astype(np.int64) * self.dtype.itemsize
        if n and (ptrs[0] != 0 or np.any(ptrs[1:] != ptrs[:-1] + nbytes[:-1])):
            bad = 0 if ptrs[0] != 0 else 1 + int(np.argmax(ptrs[1:] != ptrs[:-1] + nbytes[:-1]))
            self._fail(path, f"byte pointer of sequence {bad} ({int(ptrs[bad])}) disagrees with the sizes "
                             "before it (corrupt index)")
        self._expected_bin_bytes = int(ptrs[-1] + nbytes[-1]) if n else 0

    def _map_bin(self) -> None:
        actual = os.path.getsize(self.bin_path)
        if actual != self._expected_bin_bytes:
            kind = "truncated" if actual < self._expected_bin_bytes else "longer than its index"
            raise CorruptDatasetError(
                f"{self.bin_path}: {actual} bytes, but {self.idx_path} describes {self._expected_bin_bytes} "
                f"({kind}; the .bin and .idx must come from the same preprocessing run)")
        if actual == 0:
            self._bin = np.empty(0, self.dtype)
        else:
            # a plain ndarray view of the map: slicing an np.memmap subclass costs Python overhead per call
            self._bin = np.memmap(self.bin_path, self.dtype, mode="r").view(np.ndarray)

    # --- access -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.pointers[i] // self.dtype.itemsize
        return self._bin[start:start + self.sizes[i]]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (zero-copy view)."""
        start = self.pointers[i] // self.dtype.itemsize + offset
        end = start + (self.sizes[i] - offset if length is None else length)
        return self._bin[start:end]

    def token_array(self) -> np.ndarray:
        """All tokens, memory-mapped (for scans such as the max-id check)."""
        return self._bin

    @property
    def prefixes(self) -> list[str]:
        return [self.prefix]

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"
