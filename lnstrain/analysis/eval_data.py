"""Validation batches for the depth analysis from a Megatron-format token file.

The token stream (documents back to back, as packed training sees them) is cut into
consecutive, non-overlapping windows of seq_len + 1 tokens from the start: deterministic, so
two runs analysed on the same prefix see exactly the same tokens.
"""

from __future__ import annotations

import torch

from lnstrain.analysis.representations import Batch
from lnstrain.data.indexed_dataset import IndexedDataset


def windows_to_batches(windows: torch.Tensor, batch_size: int) -> list[Batch]:
    """[N, seq_len + 1] token windows -> batches with every prediction counted."""
    batches = []
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        batches.append(Batch(tokens=chunk[:, :-1], labels=chunk[:, 1:], loss_mask=torch.ones_like(chunk[:, 1:])))
    return batches


def validation_batches(prefix: str, seq_len: int, num_samples: int, batch_size: int,
                       vocab_size: int | None = None) -> list[Batch]:
    """Up to `num_samples` windows of `<prefix>.bin` in batches of `batch_size`."""
    stream = IndexedDataset(prefix).token_array()
    available = len(stream) // (seq_len + 1)
    if available == 0:
        raise ValueError(f"{prefix}: {len(stream)} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")
    count = min(num_samples, available)
    windows = torch.from_numpy(stream[:count * (seq_len + 1)].astype("int64")).view(count, seq_len + 1)
    if vocab_size is not None and int(windows.max()) >= vocab_size:
        raise ValueError(f"{prefix}: token id {int(windows.max())} >= the model's vocab_size {vocab_size}; "
                         "the data was tokenized with a different tokenizer")
    return windows_to_batches(windows, batch_size)
