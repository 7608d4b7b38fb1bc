"""Held-out loss on the same validation batches every time, so evaluations along a run are comparable."""

from __future__ import annotations

import itertools
from typing import Any

from lnstrain.data import iterate_micro_batches


def validation_samples(eval_batches: int, global_batch_size: int) -> int:
    """How many validation samples one evaluation reads (the first ``eval_batches`` global batches)."""
    return eval_batches * global_batch_size


def evaluate(engine: Any, valid_dataset: Any, eval_batches: int, global_batch_size: int,
             micro_batch_size: int, dp_rank: int, dp_size: int, vocab_size: int | None = None) -> float | None:
    """Mean loss over the first ``eval_batches`` global batches of ``valid_dataset`` (None if none fit).

    ``engine.eval_loss(micro_batches)`` returns one global batch's loss, averaged over data-parallel
    ranks, so every rank returns the same number. ``vocab_size``: check every batch's token ids
    (``iterate_micro_batches``).
    """
    if valid_dataset is None or eval_batches == 0:
        return None
    per_global_batch = global_batch_size // (micro_batch_size * dp_size)
    micro_batches = iterate_micro_batches(valid_dataset, 0, global_batch_size, micro_batch_size, dp_rank, dp_size,
                                          vocab_size)
    losses = []
    for _ in range(eval_batches):
        batch = list(itertools.islice(micro_batches, per_global_batch))
        if len(batch) < per_global_batch:
            break
        losses.append(float(engine.eval_loss(batch)))
    return sum(losses) / len(losses) if losses else None
