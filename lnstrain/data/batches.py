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

from .token_check import TokenIdError

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


def _check_ids(tokens: torch.Tensor, vocab_size: int, dataset, first: int, count: int) -> None:
    lowest, highest = int(tokens.min()), int(tokens.max())
    if lowest >= 0 and highest < vocab_size:
        return
    files = ", ".join(f"{prefix}.bin" for prefix in getattr(dataset, "prefixes", [])) or "the token files"
    raise TokenIdError(f"samples [{first}, {first + count}) hold token id {highest if highest >= vocab_size else lowest}, "
                       f"outside the model's vocabulary [0, {vocab_size}): {files} changed after the launch checked "
                       "them (or their range cache beside the .idx was altered); nothing of this batch was trained "
                       "on. Restore the files (or re-run tools/preprocess_data.py), then the same command resumes")


def iterate_micro_batches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                          dp_rank: int, dp_size: int, vocab_size: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this rank's micro-batches of every remaining full global batch, starting at ``consumed_samples``.

    ``consumed_samples`` is the global count saved in checkpoints; it must be a multiple of the global batch
    size (resuming mid-batch is not defined). Stops before a global batch that the dataset cannot fill.
    With ``vocab_size`` every micro-batch's token ids are checked to lie in ``[0, vocab_size)`` before
    it is yielded (``TokenIdError``): the launch check covers the files as they were, this what is read.
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
            micro_batch = collate([dataset[i] for i in range(mb_start, mb_start + micro_batch_size)])
            if vocab_size is not None:
                _check_ids(micro_batch["tokens"], vocab_size, dataset, mb_start, micro_batch_size)
            yield micro_batch
        start += global_batch_size
    logger.info("data exhausted after %d samples (dataset has %d)", start, len(dataset))
