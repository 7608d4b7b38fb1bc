"""The residual stream of a single-process model, captured with forward hooks on its blocks.

For a model with L layers, `residual_stream` returns L + 1 hidden states [batch, seq, hidden]:
index l - 1 is the stream entering layer l (index 0: the embedding output) and index L is the
stream after the last layer (before the final norm). Blocks are ordered by their global
`layer_number`, never by module position.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from lnstrain.model.block import TransformerBlock


@dataclass
class Batch:
    """Next-token prediction inputs: predict labels[b, t] from tokens[b, :t+1] where loss_mask is 1."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor


def transformer_blocks(model: nn.Module) -> list[TransformerBlock]:
    """The model's blocks by global layer number; they must be 1..L without gaps."""
    blocks = sorted((m for m in model.modules() if isinstance(m, TransformerBlock)), key=lambda b: b.layer_number)
    numbers = [b.layer_number for b in blocks]
    if numbers != list(range(1, len(blocks) + 1)):
        raise ValueError(f"expected layers 1..{len(blocks)} in one process, found layer numbers {numbers}; "
                         "consolidate a pipeline-parallel checkpoint first")
    return blocks


@contextmanager
def capture_residual_stream(model: nn.Module) -> Iterator[list[torch.Tensor | None]]:
    """Within the block, every forward of `model` fills the yielded list (see module docstring)."""
    blocks = transformer_blocks(model)
    states: list[torch.Tensor | None] = [None] * (len(blocks) + 1)

    def keep_input(index: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            states[index] = args[0].detach()
        return hook

    handles = [block.register_forward_pre_hook(keep_input(i)) for i, block in enumerate(blocks)]
    handles.append(blocks[-1].register_forward_hook(
        lambda _module, _args, output: states.__setitem__(len(blocks), output.detach())))
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def residual_stream(model: nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The L + 1 residual-stream states of one forward pass over tokens [batch, seq]."""
    with capture_residual_stream(model) as states:
        model(tokens)
    return list(states)


def iterate_residual_streams(model: nn.Module, batches: Iterable[Batch]) -> Iterator[tuple[Batch, list[torch.Tensor]]]:
    """(batch, its L + 1 states) for each batch, in eval mode and without gradients."""
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            yield batch, residual_stream(model, batch.tokens)
    finally:
        model.train(was_training)
