"""What the depth analyses need of a model, and lnstrain's own models as such a source.

Every analysis (variance, angular distance, layer pruning, multiple choice) sees a model only
through `DepthModel`: an ordered list of residual blocks, a function from token ids to logits, and a
few facts (vocabulary, context length, norm scheme, the pre-sublayer norm gains). From those alone
the base class gives, with forward hooks on the blocks and nothing model-specific:

- the residual stream: L + 1 states, index l - 1 entering layer l (0: the embedding output), index
  L after the last layer (before the final norm);
- layer l skipped: the block still runs, but its output is replaced by its input, so every other
  block keeps its own weights, layer index, attention type and mask.

Sources: `LnstrainDepthModel` here (a single-process `Transformer`), `hf_source.HFDepthModel` (a
Hugging Face model through transformers). A block's hidden-state input is its first positional
argument or its ``hidden_states`` keyword; its output is a tensor, or a tuple or list starting with one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lnstrain.model.block import TransformerBlock
from lnstrain.model.norm_schemes import Placement

LNSTRAIN_NORM_NAMES = {Placement.PRE: ("attention_input", "mlp_input"),
                       Placement.SANDWICH: ("attention_input", "mlp_input"),
                       Placement.POST: ("attention_residual", "mlp_residual")}
"""The roles of an lnstrain block's attention_norm and mlp_norm, by placement (the norms a sandwich
block adds on the sublayer outputs are not among the reported gains)."""


def _hidden_input(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _hidden_output(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_hidden_output(output: Any, hidden: torch.Tensor) -> Any:
    """`output` with its hidden state replaced by `hidden` (same structure: tensor or tuple)."""
    if isinstance(output, torch.Tensor):
        return hidden
    return [hidden, *output[1:]] if isinstance(output, list) else (hidden, *output[1:])


class DepthModel(ABC):
    """A model as the depth analyses see it (see the module docstring)."""

    module: nn.Module
    """The whole model (its train/eval mode is switched around the measurements)."""
    name: str
    """Default display name of its analysis."""
    norm_scheme: str
    vocab_size: int
    """Logits past this index (padding rows) are ignored."""
    max_seq_len: int
    source: str
    """What was loaded and how, for the report (e.g. "lnstrain checkpoint, fp32")."""
    norm_names: tuple[str, ...]
    """What each entry of a layer's `norm_gains` is (e.g. "attention_input", "mlp_output")."""

    @abstractmethod
    def layers(self) -> Sequence[nn.Module]:
        """The L residual blocks in order of depth (layer l is index l - 1)."""

    @abstractmethod
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, seq, >= vocab_size] next-token logits of tokens [batch, seq] (on `input_device`)."""

    @abstractmethod
    def norm_gains(self) -> list[list[float]]:
        """[L][len(norm_names)]: mean |effective gain| of each of layer l's norms."""

    @property
    def num_layers(self) -> int:
        return len(self.layers())

    @property
    def input_device(self) -> torch.device:
        """Where token ids go in (the embedding's device)."""
        return next(self.module.parameters()).device

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Eval mode and no gradients, the previous mode restored afterwards."""
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.module.train(was_training)

    @contextmanager
    def capture_residual_stream(self) -> Iterator[list[torch.Tensor | None]]:
        """Within the block, every forward fills the yielded list with the L + 1 states, detached and
        on `input_device` (so that states of a model spread over devices can be compared)."""
        blocks = self.layers()
        states: list[torch.Tensor | None] = [None] * (len(blocks) + 1)
        device = self.input_device

        def keep_input(index: int):
            def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
                states[index] = _hidden_input(args, kwargs).detach().to(device)
            return hook

        def keep_last_output(_module: nn.Module, _args: tuple, output: Any) -> None:
            states[len(blocks)] = _hidden_output(output).detach().to(device)

        handles = [block.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, block in enumerate(blocks)]
        handles.append(blocks[-1].register_forward_hook(keep_last_output))
        try:
            yield states
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def layer_skipped(self, layer_number: int) -> Iterator[None]:
        """Within the block, layer `layer_number` (1-based) passes its input through unchanged."""
        blocks = self.layers()
        if not 1 <= layer_number <= len(blocks):
            raise ValueError(f"layer {layer_number} out of range: the model has layers 1..{len(blocks)}")

        def identity(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            return _with_hidden_output(output, _hidden_input(args, kwargs))

        handle = blocks[layer_number - 1].register_forward_hook(identity, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def transformer_blocks(model: nn.Module) -> list[TransformerBlock]:
    """An lnstrain model's blocks by global layer number; they must be 1..L without gaps."""
    blocks = sorted((m for m in model.modules() if isinstance(m, TransformerBlock)), key=lambda b: b.layer_number)
    numbers = [b.layer_number for b in blocks]
    if numbers != list(range(1, len(blocks) + 1)):
        raise ValueError(f"expected layers 1..{len(blocks)} in one process, found layer numbers {numbers}; "
                         "consolidate a pipeline-parallel checkpoint first")
    return blocks


class LnstrainDepthModel(DepthModel):
    """A single-process lnstrain `Transformer`."""

    def __init__(self, model: nn.Module, source: str = "lnstrain") -> None:
        cfg = model.cfg
        self.module = model
        self.norm_scheme = getattr(cfg.norm_scheme, "value", str(cfg.norm_scheme))
        self.name = self.norm_scheme
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = cfg.max_seq_len
        self.source = source
        self._blocks = transformer_blocks(model)
        placements = {block.layout.placement for block in self._blocks}
        self.norm_names = (LNSTRAIN_NORM_NAMES[placements.pop()] if len(placements) == 1
                           else ("attention_norm", "mlp_norm"))

    def layers(self) -> Sequence[nn.Module]:
        return self._blocks

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(tokens)

    def norm_gains(self) -> list[list[float]]:
        """Mean |gain| times any factor the scheme applies to the norm's output (LNS's 1/sqrt(l))."""
        return [[float(norm.weight.detach().abs().mean()) * getattr(norm, "output_scale", 1.0)
                 for norm in (block.attention_norm, block.mlp_norm)] for block in self._blocks]


def as_depth_model(model: nn.Module | DepthModel) -> DepthModel:
    """`model` itself when it is a `DepthModel`, else an lnstrain `Transformer` wrapped as one."""
    return model if isinstance(model, DepthModel) else LnstrainDepthModel(model)
