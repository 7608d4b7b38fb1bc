"""One naming for the model's parameters, whatever the layout: the single-process ``Transformer``'s.

    embedding.word_embeddings.weight        layers.{ℓ-1}.attention.qkv_proj.weight   output.final_norm.weight
    layers.{ℓ-1}.attention_norm.weight      layers.{ℓ-1}.mlp.gate_up_proj.weight     output.head.weight (untied)

A pipeline module names its entries by DeepSpeed's position (``3.attention.qkv_proj.weight``;
tied embeddings under ``tied_modules.<key>.``); here they are mapped back through what the entry is
and, for a transformer layer, through the global layer number ℓ it carries, never through the
position. "Full" tensors are the single-process model's: unsharded, with the vocabulary padded for
tensor size 1 (``cfg.padded_vocab_size(1)``).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn

from lnstrain.model.block import TransformerBlock
from lnstrain.model.config import ModelConfig
from lnstrain.model.transformer import EmbeddingStage, OutputStage, Transformer
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

if TYPE_CHECKING:
    from collections.abc import Callable

    from deepspeed.pipe import LayerSpec

TIED_PREFIX = "tied_modules."


def stage_prefix(stage_class: type, layer_number: int | None) -> str:
    """The canonical name prefix of one model entry (an embedding, a layer, the output stage)."""
    if issubclass(stage_class, TransformerBlock):
        if layer_number is None:
            raise ValueError("a transformer layer entry needs its layer number")
        return f"layers.{layer_number - 1}."
    if issubclass(stage_class, EmbeddingStage):
        return "embedding."
    if issubclass(stage_class, OutputStage):
        return "output."
    raise ValueError(f"unknown model entry {stage_class.__name__}: cannot name its parameters")


def _pipeline_entry_prefixes(cfg: ModelConfig) -> dict[int, str]:
    """DeepSpeed pipeline position -> canonical prefix, from the specs ``pipeline.layer_specs`` builds."""
    from lnstrain.model.pipeline import layer_specs

    prefixes = {}
    for index, spec in enumerate(layer_specs(cfg, ParallelGroups.single_process())):
        number = _spec_layer_number(spec) if issubclass(spec.typename, TransformerBlock) else None
        prefixes[index] = stage_prefix(spec.typename, number)
    return prefixes


def _spec_layer_number(spec: LayerSpec) -> int:
    """The ``layer_number`` a transformer layer's spec will construct it with, passed by position or keyword."""
    arguments = inspect.signature(spec.typename).bind(*spec.module_args, **spec.module_kwargs).arguments
    return arguments["layer_number"]


def _canonical(name: str, entry_prefix: Callable[[int], str]) -> str:
    if name.startswith(TIED_PREFIX):  # tied_modules.<key>.<the embedding's own names>
        return "embedding." + name[len(TIED_PREFIX):].split(".", 1)[1]
    index, rest = name.split(".", 1)
    return entry_prefix(int(index)) + rest


def saved_pipeline_name_mapper(cfg: ModelConfig) -> Callable[[str], str]:
    """Maps the parameter names of a saved pipeline (``5.head.weight``) to canonical names."""
    prefixes = _pipeline_entry_prefixes(cfg)
    return lambda name: _canonical(name, prefixes.__getitem__)


def module_name_mapper(module: nn.Module) -> Callable[[str], str]:
    """Maps the parameter names of a live model (``Transformer`` or pipeline stage) to canonical names."""
    if isinstance(module, Transformer):
        return lambda name: name

    def entry_prefix(index: int) -> str:
        entry = module._modules[str(index)]
        return stage_prefix(type(entry), getattr(entry, "layer_number", None))

    return lambda name: _canonical(name, entry_prefix)


def owner_of(module: nn.Module, name: str) -> nn.Module:
    """The module that holds parameter ``name``."""
    return module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module


def is_vocab_sharded(owner: nn.Module) -> bool:
    """Whether the owner's weight has one row per (padded) vocabulary entry."""
    return isinstance(owner, VocabParallelEmbedding) or (
        isinstance(owner, ColumnParallelLinear) and [p.name for p in owner.parts] == ["vocab"])


def fit_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Drop or zero-pad vocabulary padding rows so that the tensor has ``rows`` rows."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    padding = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, padding])


def single_process_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Canonical name -> full shape of every parameter of ``cfg``'s model (built on the meta device)."""
    with torch.device("meta"):
        model = Transformer(cfg, ParallelGroups.single_process())
    return {name: param.shape for name, param in model.named_parameters()}


def tensor_parallel_template(cfg: ModelConfig, tensor_parallel: int) -> Transformer:
    """A meta-device model at tensor size ``tensor_parallel`` whose layers know how shards fit together."""
    with torch.device("meta"):
        return Transformer(cfg, ParallelGroups(tp_size=tensor_parallel))
