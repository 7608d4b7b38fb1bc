"""Global batches -> this data-parallel rank's micro-batches, resumable from the consumed-sample count.

Global batch ``g`` (counted from the start of training) is dataset samples
``[g * GB, (g + 1) * GB)``; data-parallel rank ``r`` of ``dp`` reads only its contiguous slice
``[g * GB + r * GB / dp, g * GB + (r + 1) * GB / dp)``, in micro-batches of ``mb`` samples. The sequence
of global batches therefore depends only on the dataset and the number of consumed samples: it is the
same whether the run was interrupted or not, and whatever the data-parallel size.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """``{"tokens": LongTensor[mb, seq_len + 1], "loss_mask": FloatTensor[mb, seq_len]}``.

    Inputs are ``tokens[:, :-1]``, labels ``tokens[:, 1:]``; ``loss_mask`` weights each label.
    """
    import torch  # here, so that the preprocessing tools and their workers never pay for importing torch

    return {"tokens": torch.from_numpy(np.stack([s["tokens"] for s in samples])),
            "loss_mask": torch.from_numpy(np.stack([s["loss_mask"] for s in samples]))}


def iterate_micro_batches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                          dp_rank: int, dp_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's micro-batches of every remaining full global batch, starting at ``consumed_samples``.

    ``consumed_samples`` is the global count saved in checkpoints; it must be a multiple of the global batch
    size (resuming mid-batch is not defined). Stops before a global batch that the dataset cannot fill.
    """
    if global_batch_size <= 0 or micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"batch sizes and dp_size must be > 0 (got global_batch_size={global_batch_size}, "
                         f"micro_batch_size={micro_batch_size}, dp_size={dp_size})")
    if global_batch_size % (micro_batch_size * dp_size) != 0:
        raise ValueError(f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size "
                         f"({micro_batch_size}) x data-parallel size ({dp_size}) = {micro_batch_size * dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}) (got {dp_rank})")
    if consumed_samples < 0 or consumed_samples % global_batch_size != 0:
        raise ValueError(f"consumed_samples ({consumed_samples}) must be a non-negative multiple of "
                         f"global_batch_size ({global_batch_size})")
    per_rank = global_batch_size // dp_size
    start = consumed_samples
    while start + global_batch_size <= len(dataset):
        first = start + dp_rank * per_rank
        for mb_start in range(first, first + per_rank, micro_batch_size):
            yield collate([dataset[i] for i in range(mb_start, mb_start + micro_batch_size)])
        start += global_batch_size
    logger.info("data exhausted after %d samples (dataset has %d)", start, len(dataset))
