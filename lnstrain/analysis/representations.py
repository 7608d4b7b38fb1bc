"""The residual stream of a model, batch by batch, for the variance and angular-distance analyses.

For a model with L layers, `residual_stream` returns L + 1 hidden states [batch, seq, hidden]:
index l - 1 is the stream entering layer l (index 0: the embedding output) and index L is the
stream after the last layer (before the final norm). How they are captured is `DepthModel`'s
(`model_source.py`); lnstrain blocks are ordered by their global `layer_number`, never by module
position.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lnstrain.analysis.model_source import DepthModel, as_depth_model, transformer_blocks

__all__ = ["Batch", "iterate_residual_streams", "residual_stream", "transformer_blocks"]


@dataclass
class Batch:
    """Next-token prediction inputs: predict labels[b, t] from tokens[b, :t+1] where loss_mask is 1."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


def residual_stream(model: nn.Module | DepthModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The L + 1 residual-stream states of one forward pass over tokens [batch, seq]."""
    model = as_depth_model(model)
    with model.evaluating(), model.capture_residual_stream() as states:
        model.logits(tokens.to(model.input_device))
    return list(states)


def iterate_residual_streams(model: nn.Module | DepthModel,
                             batches: Iterable[Batch]) -> Iterator[tuple[Batch, list[torch.Tensor]]]:
    """(batch, its L + 1 states) for each batch, in eval mode and without gradients."""
    model = as_depth_model(model)
    with model.evaluating(), model.capture_residual_stream() as states:
        for batch in batches:
            model.logits(batch.tokens.to(model.input_device))
            yield batch, list(states)
