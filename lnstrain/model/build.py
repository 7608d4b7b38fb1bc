"""How the model becomes parallel, in two calls that every rank makes in the same order.

1. ``build_groups(config)``: every process group the run communicates over (``ParallelGroups.build``):
   tensor, context, pipeline and data groups (and data × context), the blocks of tensor ranks that share
   a replicated key/value head (``attention.kv_head_copies``), and DeepSpeed's communication layer.
2. ``build_model(config, groups)``: this rank's share of the model, creating none of those groups
   (DeepSpeed's ``PipelineModule`` builds its own grid of them, checked against ours). Tensor
   parallelism is inside the layers (``parallel.layers``: each rank holds its shard of the
   projections and embeddings; norms are replicated). At pipeline size 1 that is a ``Transformer``;
   with a pipeline, this rank's stage of a DeepSpeed ``PipelineModule`` (``model.pipeline``), cut
   between layers that keep their global number ℓ, so LNS's 1/√ℓ is the same in every layout.
   Activation checkpointing, ``precision.fp8`` (``set_fp8_mode``: the blocks' linear layers only) and
   ``train.compile`` (``config.feasibility.compiles_layers``: on CUDA by default, never at ZeRO 3) are
   applied here, to every ``TransformerBlock``, once.
3. ``select_triton_kernels(module, device, dtype)``, once the model is on its device: each Triton kernel
   (the q|k|v rotation, SwiGLU) stays on where it runs on that device and dtype and has given the eager
   ops' bits there, and is turned off elsewhere, so that compiled layers fuse plain ops instead of calling
   an opaque operator that would run the eager ops.

Data parallelism and ZeRO are DeepSpeed's: ``training.engine.build_engine`` hands the module to
``deepspeed.initialize``. Weights are drawn per parameter name from ``model.init_seed``, so every
layout starts from the same model (``model.init``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from lnstrain.config.feasibility import compiles_layers
from lnstrain.model.attention import kv_head_copies, sdpa_backends
from lnstrain.model.block import TransformerBlock
from lnstrain.model.kernels import swiglu_kernel_usable
from lnstrain.model.mlp import SwiGLUMLP
from lnstrain.model.rotary import RotaryEmbedding, kernel_usable
from lnstrain.model.transformer import Transformer
from lnstrain.parallel.float8 import recipe_for
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.parallel.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from lnstrain.config.run_config import Config

logger = logging.getLogger(__name__)


def build_groups(config: Config) -> ParallelGroups:
    """This rank's process groups for ``config``'s layout and model (collective: every rank calls it)."""
    parallel = config.parallel
    return ParallelGroups.build(parallel.tensor, parallel.pipeline, parallel.sequence_parallel,
                                tp_replica_copies=kv_head_copies(config.model, parallel.tensor),
                                context=parallel.context, context_method=parallel.context_method)


def build_model(config: Config, groups: ParallelGroups, device_type: str = "cpu") -> nn.Module:
    """This rank's model: a ``Transformer`` at pipeline size 1, else its ``PipelineModule`` stage, with
    ``config.train``'s activation checkpointing and compilation applied; ``device_type`` is where it will
    train (``train.compile: auto`` compiles on ``cuda`` only)."""
    if groups.pp_size > 1:
        from lnstrain.model.pipeline import build_pipeline_module  # imports DeepSpeed's pipeline: seconds

        module = build_pipeline_module(config.model, config.parallel, groups)
    else:
        module = Transformer(config.model, groups)
    blocks = [block for block in module.modules() if isinstance(block, TransformerBlock)]
    attention_kernels = sdpa_backends(config.model.attention_backend, device_type)
    for block in blocks:
        block.set_activation_checkpointing(config.train.activation_checkpointing)
        block.attention.sdpa_backends = attention_kernels
    set_fp8_mode(module, config.precision.fp8, device_type)
    if compiles_layers(config, device_type):
        backend = config.train.compile_backend
        logger.info("train.compile: torch.compile (%s) compiles the transformer layers during the first step", backend)
        for block in blocks:
            block.compile(backend=backend)
    return module


def set_fp8_mode(module: nn.Module, mode: str, device_type: str | None = None) -> int:
    """Make the linear layers of ``module``'s transformer blocks compute in float8 by ``mode``
    (``precision.fp8``: ``none``, ``tensorwise`` or ``rowwise``), in place, on a built model or an engine's
    module alike; the embedding and the output head are never touched. ``device_type``: where the model
    trains (default: where its parameters are). Returns the number of layers set."""
    if device_type is None:
        device_type = next(module.parameters()).device.type
    recipe = recipe_for(mode, device_type)
    layers = [layer for block in module.modules() if isinstance(block, TransformerBlock)
              for layer in block.modules() if isinstance(layer, (ColumnParallelLinear, RowParallelLinear))]
    for layer in layers:
        layer.fp8 = recipe
    if recipe is not None:
        logger.info("precision.fp8 %s: %d linear layers compute in float8%s", mode, len(layers),
                    " (torch._scaled_mm's products emulated exactly off CUDA)" if recipe.emulate else "")
    return len(layers)


TRITON_KERNELS = {"rotary": (RotaryEmbedding, kernel_usable), "swiglu": (SwiGLUMLP, swiglu_kernel_usable)}
"""Each Triton kernel: the module class whose ``triton_kernel`` switches it, and whether it is usable on a
device and dtype (it runs there and gave the eager ops' bits, checked once per process)."""


def set_triton_kernel(module: nn.Module, kernel: str, on: bool) -> int:
    """Switch ``kernel`` (a key of ``TRITON_KERNELS``) on or off in every module of its class; how many."""
    module_class, _ = TRITON_KERNELS[kernel]
    switched = [m for m in module.modules() if isinstance(m, module_class)]
    for owner in switched:
        owner.triton_kernel = on
    return len(switched)


def select_triton_kernels(module: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, bool]:
    """Turn each Triton kernel on where it is usable on ``device`` in ``dtype``, off elsewhere; which are on."""
    usable = {name: usable_on(device, dtype) for name, (_, usable_on) in TRITON_KERNELS.items()}
    for name, on in usable.items():
        set_triton_kernel(module, name, on)
    logger.info("Triton kernels on %s in %s: %s", device, dtype,
                ", ".join(f"{name} {'on' if on else 'off'}" for name, on in usable.items()))
    return usable
