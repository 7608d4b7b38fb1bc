"""Validation batches for the depth analysis, from a Megatron-format token file or from raw text.

The token stream (documents back to back, as packed training sees them) is cut into
consecutive, non-overlapping windows of seq_len + 1 tokens from the start: deterministic, so
two runs analysed on the same prefix see exactly the same tokens. Raw text (`.jsonl` with a "text"
key, `.txt`, optionally `.gz`/`.zst`) is tokenized document by document by the model's own
tokenizer (`text_tokens.DocumentTokenizer.document`), only as far as the windows need.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from lnstrain.analysis.representations import Batch
from lnstrain.data.corpus_readers import expand_inputs, iter_documents
from lnstrain.data.indexed_dataset import IndexedDataset


def windows_to_batches(windows: torch.Tensor, batch_size: int) -> list[Batch]:
    """[N, seq_len + 1] token windows -> batches with every prediction counted."""
    batches = []
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        batches.append(Batch(tokens=chunk[:, :-1], labels=chunk[:, 1:], loss_mask=torch.ones_like(chunk[:, 1:])))
    return batches


def stream_to_batches(stream: np.ndarray, seq_len: int, num_samples: int, batch_size: int,
                      vocab_size: int | None, source: str) -> list[Batch]:
    """Up to `num_samples` consecutive windows of seq_len + 1 tokens from the start of `stream`."""
    available = len(stream) // (seq_len + 1)
    if available == 0:
        raise ValueError(f"{source}: {len(stream)} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")
    count = min(num_samples, available)
    windows = torch.from_numpy(stream[:count * (seq_len + 1)].astype("int64")).view(count, seq_len + 1)
    if vocab_size is not None and int(windows.max()) >= vocab_size:
        raise ValueError(f"{source}: token id {int(windows.max())} >= the model's vocab_size {vocab_size}; "
                         "the data was tokenized with a different tokenizer")
    return windows_to_batches(windows, batch_size)


def validation_batches(prefix: str, seq_len: int, num_samples: int, batch_size: int,
                       vocab_size: int | None = None) -> list[Batch]:
    """Up to `num_samples` windows of `<prefix>.bin` in batches of `batch_size`."""
    return stream_to_batches(IndexedDataset(prefix).token_array(), seq_len, num_samples, batch_size, vocab_size, prefix)


def text_batches(path: str, document: Callable[[str], list[int]], seq_len: int, num_samples: int,
                 batch_size: int, vocab_size: int | None = None) -> list[Batch]:
    """Up to `num_samples` windows of the documents in `path` (files or a glob), each tokenized by
    `document(text) -> ids` and laid back to back; reading stops once the windows are full."""
    needed = num_samples * (seq_len + 1)
    stream: list[int] = []
    for text in iter_documents(expand_inputs([path])):
        stream.extend(document(text))
        if len(stream) >= needed:
            break
    return stream_to_batches(np.asarray(stream, dtype=np.int64), seq_len, num_samples, batch_size, vocab_size, path)
