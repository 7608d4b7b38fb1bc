"""Micro-batches -> model inputs and per-token loss weights, the same for every layout.

A micro-batch is the data layer's dict ``{"tokens": int64[mb, seq + 1], "loss_mask": float[mb, seq]}``
(``loss_mask`` optional: all ones). The model reads ``tokens[:, :-1]`` and predicts
``tokens[:, 1:]``; ``loss_mask[b, t]`` says whether that prediction counts (0 for padding and for
tokens the data layer excludes).

The reported loss is the mean over every counted token of the global batch, however the batch is
split into micro-batches, data-parallel ranks and context chunks. DeepSpeed averages per-micro-batch
losses over its data-parallel ranks, which are lnstrain's data × context ranks (divides by the
accumulation steps, then by ``dcp_size`` = data-parallel size × context size), so each micro-batch's
loss is its *sum* of token losses times ``weight = accumulation_steps * dcp_size / counted_tokens_in_global_batch``:
their DeepSpeed average is then exactly ``sum of token losses / counted tokens``, and so are the gradients. One
all-reduce of a scalar over the data-parallel group finds the token count (every context rank holds
the whole micro-batches, so counts alike). The loss itself, ``sum(token loss * weight)``, is
``lnstrain.model.loss.weighted_token_loss``.

Context parallelism: every rank of a context group gets the same micro-batches (whole samples) and
keeps its two chunks of each sequence (``parallel.context.split_for_context``) of the inputs, the
labels and the weights, after the count; the labels are shifted before the cut, so the token at the
end of a chunk predicts the first token of the next one, as on one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lnstrain.parallel.context import split_for_context
from lnstrain.parallel.groups import collective_device

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups

MicroBatch = dict[str, torch.Tensor]


@dataclass
class WeightedMicroBatch:
    """Model inputs, targets and per-token loss weights of one micro-batch."""

    inputs: torch.Tensor   # int64 [mb, seq / context]: this context rank's chunks
    labels: torch.Tensor   # int64 [mb, seq / context]
    weights: torch.Tensor  # float32 [mb, seq / context]: loss_mask * accumulation * dcp_size / counted tokens


def split_tokens(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, labels, loss_mask) of one micro-batch."""
    if "tokens" not in batch:
        raise KeyError(f"a micro-batch needs 'tokens' (int64 [batch, seq + 1]); got keys {sorted(batch)}")
    tokens = batch["tokens"].long()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss_mask = batch.get("loss_mask")
    loss_mask = torch.ones(labels.shape) if loss_mask is None else torch.as_tensor(loss_mask).float()
    if loss_mask.shape != labels.shape:
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected {tuple(labels.shape)} "
                         "(one entry per predicted token: tokens has seq + 1 columns)")
    return inputs, labels, loss_mask


def weigh_micro_batches(micro_batches: list[MicroBatch], groups: ParallelGroups,
                        device: torch.device | str = "cpu") -> tuple[list[WeightedMicroBatch], float]:
    """Loss weights making DeepSpeed's micro-batch average the global token-weighted mean, each
    micro-batch cut to this context rank's chunks.

    Returns the weighted micro-batches and the number of counted tokens in the global batch
    (all data-parallel ranks). A global batch with no counted token gets weight 0 (loss 0).
    """
    if not micro_batches:
        raise ValueError("train/eval step called with no micro-batches")
    split = [split_tokens(batch) for batch in micro_batches]
    total = float(sum(mask.sum().item() for _, _, mask in split))
    if groups.dp_size > 1:
        counted = torch.tensor([total], dtype=torch.float64, device=collective_device(groups.dp_group))
        dist.all_reduce(counted, group=groups.dp_group)
        total = counted.item()
    scale = len(micro_batches) * groups.dcp_size / total if total > 0 else 0.0
    weighted = [WeightedMicroBatch(*(split_for_context(tensor, 1, groups).to(device)
                                     for tensor in (inputs, labels, mask * scale)))
                for inputs, labels, mask in split]
    return weighted, total

