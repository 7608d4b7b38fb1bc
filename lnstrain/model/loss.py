"""The language-model loss: next-token cross-entropy over the counted tokens, token-weighted.

Both reductions start from the same per-token loss (``vocab_parallel_cross_entropy``: logits stay
sharded over the vocabulary, padded entries excluded, fp32 arithmetic without an fp32 copy of the logits
unless ``model.cross_entropy: fp32_logits``):

- ``weighted_token_loss``: sum(token loss * weight). Training's loss, on the plain and the pipeline
  path alike: ``training.batches.weigh_micro_batches`` picks the weights so that DeepSpeed's
  average over micro-batches and data-parallel ranks is the mean over the global batch's counted tokens.
- ``language_model_loss``: the mean over the tokens a ``loss_mask`` counts, in one batch
  (``Transformer.loss``); the same thing with weights ``loss_mask / counted tokens``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lnstrain.parallel.cross_entropy import vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from lnstrain.model.config import ModelConfig
    from lnstrain.parallel.groups import ParallelGroups


def token_losses(logits: torch.Tensor, labels: torch.Tensor, cfg: ModelConfig,
                 groups: ParallelGroups) -> torch.Tensor:
    """Per-token cross-entropy [batch, seq] (fp32) from this rank's logits [batch, seq, padded_vocab / tp],
    by ``cfg.cross_entropy``'s implementation as it is at this call."""
    return vocab_parallel_cross_entropy(logits, labels, groups, cfg.vocab_size, cfg.cross_entropy)


def weighted_token_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                        cfg: ModelConfig, groups: ParallelGroups) -> torch.Tensor:
    """sum(token cross-entropy * weight): an fp32 scalar, identical on the ranks of a TP group."""
    per_token = token_losses(logits, labels, cfg, groups)
    return (per_token * weights.to(per_token.dtype)).sum()


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor, cfg: ModelConfig, groups: ParallelGroups,
                        loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32 scalar) over the tokens where loss_mask is nonzero
    (all tokens when None).

    logits: [batch, seq, padded_vocab / tp] from OutputStage; labels: [batch, seq].
    """
    per_token = token_losses(logits, labels, cfg, groups)
    if loss_mask is None:
        return per_token.mean()
    loss_mask = loss_mask.to(per_token.dtype)
    return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
