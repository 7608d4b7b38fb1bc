"""Activation memory of any model size, traced on fake tensors: where the bytes go, without a GPU.

``trace_activations`` builds the single-process model (one tensor rank, one stage) under
``FakeTensorMode`` in the engine's weight dtype, runs one micro-batch's forward and backward with the
configured activation checkpointing, and measures with ``LiveTensorBytes``: the bytes each layer
keeps for backward, the forward's peak above the weights, and the peak over forward and backward
(the gradients included). Nothing is allocated, so a 7B model traces on a laptop in seconds.

The CPU's kernels stand in for CUDA's: the same saved tensors and the same loss transients (the
chunked loss's one fp32 chunk; with ``model.cross_entropy: fp32_logits`` an fp32 copy of bf16 logits,
which ATen's log-softmax makes on CUDA too, and skips only for fp16 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lnstrain.benchmark.tensor_memory import LiveTensorBytes
from lnstrain.config.run_config import Config

WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class ActivationTrace:
    weights: int
    """Bytes of the model's weights (engine dtype)."""
    kept_per_layer: list[int]
    """Bytes each transformer layer adds to what is kept for backward, in layer order."""
    kept_after_forward: int
    """Bytes kept for backward once the loss is computed (all layers, the head and the loss)."""
    forward_peak: int
    """Peak bytes above the weights during the forward (transients of the loss included)."""
    peak: int
    """Peak bytes above the weights over forward and backward (gradients included)."""


def trace_activations(config: Config) -> ActivationTrace:
    """One micro-batch of ``config``'s model at one tensor rank and one stage, on fake tensors."""
    from lnstrain.model.block import TransformerBlock
    from lnstrain.model.transformer import Transformer
    from lnstrain.parallel.groups import ParallelGroups

    tracker = LiveTensorBytes()
    after_layer: list[int] = []
    default_dtype = torch.get_default_dtype()
    with FakeTensorMode(), tracker:
        torch.set_default_dtype(WEIGHT_DTYPES[config.precision.dtype])  # DeepSpeed trains the weights in it
        try:
            model = Transformer(config.model, ParallelGroups.single_process())
        finally:
            torch.set_default_dtype(default_dtype)
        model.set_activation_checkpointing(config.train.activation_checkpointing)
        blocks = [module for module in model.modules() if isinstance(module, TransformerBlock)]
        blocks[0].register_forward_pre_hook(lambda _module, _args: after_layer.append(tracker.live))
        for block in blocks:
            block.register_forward_hook(lambda _module, _args, _output: after_layer.append(tracker.live))
        baseline = tracker.live  # the weights, and the norms' 0-dim fp32 output factors (not weights)
        weights = sum(tensor.numel() * tensor.element_size()
                      for tensor in (*model.parameters(), *model.buffers()))
        tokens = torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size, config.data.seq_len))
        tracker.reset_peak()
        loss = model.loss(tokens, tokens)
        kept, forward_peak = tracker.live - baseline, tracker.peak - baseline
        boundaries = after_layer[:len(blocks) + 1]  # recomputation in backward calls the hooks again
        loss.backward()
    kept_per_layer = [later - earlier for earlier, later in zip(boundaries, boundaries[1:])]
    return ActivationTrace(weights=weights, kept_per_layer=kept_per_layer, kept_after_forward=kept,
                           forward_peak=forward_peak, peak=tracker.peak - baseline)
