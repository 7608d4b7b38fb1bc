"""Validation windows for the depth analysis, from a Megatron-format token file or from raw text.

The token stream (documents back to back, as packed training sees them) is cut into
consecutive, non-overlapping windows of seq_len + 1 tokens from the start: deterministic, so
two runs analysed on the same prefix see exactly the same tokens. Raw text (`.jsonl` with a "text"
key, `.txt`, optionally `.gz`/`.zst`) is tokenized document by document by the model's own
tokenizer (`text_tokens.DocumentTokenizer.document`), only as far as the windows need. Each set of
windows comes with its `windows.WindowRecord`; fewer windows than asked (the source ran out) is a
warning that gives both numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from lnstrain.analysis.representations import Batch
from lnstrain.analysis.text_tokens import DocumentTokenizer
from lnstrain.analysis.windows import WindowRecord, sources_checksum, tokens_checksum
from lnstrain.data.corpus_readers import expand_inputs, iter_documents
from lnstrain.data.indexed_dataset import IndexedDataset

logger = logging.getLogger(__name__)


@dataclass
class Windows:
    """The batches an analysis runs on, and their record."""

    batches: list[Batch]
    record: WindowRecord


def windows_to_batches(windows: torch.Tensor, batch_size: int) -> list[Batch]:
    """[N, seq_len + 1] token windows -> batches with every prediction counted."""
    batches = []
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        batches.append(Batch(tokens=chunk[:, :-1], labels=chunk[:, 1:], loss_mask=torch.ones_like(chunk[:, 1:])))
    return batches


def cut_windows(stream: np.ndarray, seq_len: int, num_samples: int, vocab_size: int | None, source: str) -> torch.Tensor:
    """[count, seq_len + 1]: up to `num_samples` consecutive windows from the start of `stream`."""
    available = len(stream) // (seq_len + 1)
    if available == 0:
        raise ValueError(f"{source}: {len(stream)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
    count = min(num_samples, available)
    if count < num_samples:
        logger.warning("%s holds only %d windows of %d tokens; %d were asked for: the analysis uses %d",
                       source, count, seq_len + 1, num_samples, count)
    windows = torch.from_numpy(stream[:count * (seq_len + 1)].astype("int64")).view(count, seq_len + 1)
    if vocab_size is not None and int(windows.max()) >= vocab_size:
        raise ValueError(f"{source}: token id {int(windows.max())} >= the model's vocab_size {vocab_size}; "
                         "the data was tokenized with a different tokenizer")
    return windows


def token_file_windows(prefix: str, seq_len: int, num_samples: int, batch_size: int, vocab_size: int | None = None,
                       tokenizer: DocumentTokenizer | None = None) -> Windows:
    """Up to `num_samples` windows of `<prefix>.bin` in batches of `batch_size`; `tokenizer`: the one
    that made the file, when known (recorded, not used)."""
    windows = cut_windows(IndexedDataset(prefix).token_array(), seq_len, num_samples, vocab_size, prefix)
    record = WindowRecord(seq_len=seq_len, count=len(windows), requested=num_samples, start=0, source=prefix,
                          source_kind="token file",
                          source_sha256=sources_checksum([f"{prefix}.bin", f"{prefix}.idx"]),
                          tokenizer=tokenizer.description if tokenizer else "not recorded",
                          tokenizer_sha256=tokenizer.checksum if tokenizer else None,
                          tokens_sha256=tokens_checksum(windows))
    return Windows(windows_to_batches(windows, batch_size), record)


def text_windows(path: str, tokenizer: DocumentTokenizer, seq_len: int, num_samples: int, batch_size: int,
                 vocab_size: int | None = None) -> Windows:
    """Up to `num_samples` windows of the documents in `path` (files or a glob), each tokenized by
    `tokenizer.document` and laid back to back; reading stops once the windows are full."""
    files = expand_inputs([path])
    needed = num_samples * (seq_len + 1)
    stream: list[int] = []
    for text in iter_documents(files):
        stream.extend(tokenizer.document(text))
        if len(stream) >= needed:
            break
    windows = cut_windows(np.asarray(stream, dtype=np.int64), seq_len, num_samples, vocab_size, path)
    record = WindowRecord(seq_len=seq_len, count=len(windows), requested=num_samples, start=0,
                          source=path if len(files) == 1 else f"{path} ({len(files)} files)", source_kind="text",
                          source_sha256=sources_checksum(files), tokenizer=tokenizer.description,
                          tokenizer_sha256=tokenizer.checksum, tokens_sha256=tokens_checksum(windows))
    return Windows(windows_to_batches(windows, batch_size), record)

