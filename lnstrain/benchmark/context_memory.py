"""Activation memory per rank at several context sizes for one long sequence, beside the estimate
(``tools/benchmark_context.py``).

Every rank of a ``context``-rank world (gloo on the CPU) builds the model under ``LiveTensorBytes``,
runs one warm-up forward (rotary tables and other per-module caches are built there, as in a step
after the first), then one micro-batch's forward and loss on its chunks of the sequence
(``training.batches.weigh_micro_batches``): what is alive after the loss is what the step keeps for
backward, the estimate's ``activations`` (``estimate.memory``, device ``cpu``). The peak of the
forward and of the backward that follows (above the weights, gradients included) are reported too.
No DeepSpeed engine: weights, gradients and optimizer state are the same at every context size, and
the estimate's terms for them are checked by ``tools/measure_memory.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lnstrain.config.run_config import Config
from lnstrain.estimate.memory import memory_estimate
from lnstrain.parallel.local_ranks import run_distributed


@dataclass(frozen=True)
class ContextMemory:
    """One context size's measurement on its most loaded rank, in bytes."""

    context: int
    method: str
    tokens_per_rank: int
    kept: int
    """Alive after the forward and the loss: kept for backward."""
    estimated: float
    """``memory_estimate(...).heaviest.activations['none']`` for the same config and rank count."""
    forward_peak: int
    backward_peak: int

    @property
    def ratio(self) -> float:
        """Estimate / measurement."""
        return self.estimated / self.kept


def _measure_rank(rank: int, world_size: int, config: Config) -> tuple[int, int, int]:
    from lnstrain.benchmark.tensor_memory import LiveTensorBytes
    from lnstrain.model.build import build_groups
    from lnstrain.model.loss import weighted_token_loss
    from lnstrain.model.transformer import Transformer
    from lnstrain.training.batches import weigh_micro_batches

    groups = build_groups(config)
    generator = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, config.model.vocab_size, (config.train.micro_batch_size,
                                                                   config.data.seq_len + 1), generator=generator)}
    [micro], _ = weigh_micro_batches([batch], groups)
    tracker = LiveTensorBytes()
    with tracker:  # the model inside too: a view of a weight made while tracking counts the weight's storage
        model = Transformer(config.model, groups)
        with torch.no_grad():
            model(micro.inputs)  # per-module caches (rotary tables) exist before what is measured
        held = tracker.live
        tracker.reset_peak()
        loss = weighted_token_loss(model(micro.inputs), micro.labels, micro.weights, config.model, groups)
        kept, forward_peak = tracker.live - held, tracker.peak - held
        tracker.reset_peak()
        loss.backward()
        backward_peak = tracker.peak - held
    return kept, forward_peak, backward_peak


def measure_context_memory(config: Config, context: int, method: str = "ring") -> ContextMemory:
    """``config``'s activation memory on ``context`` ranks sharing each sequence (``context_method``
    ``method``), its most loaded rank against the estimate."""
    config = config.replace(parallel=dataclasses.replace(config.parallel, context=context, context_method=method,
                                                         tensor=1, pipeline=1, sequence_parallel=False))
    per_rank = run_distributed(_measure_rank, context, config, timeout_s=1800)
    kept, forward_peak, backward_peak = max(per_rank)
    estimate = memory_estimate(config, context, device="cpu").heaviest.activations["none"]
    return ContextMemory(context, method, config.data.seq_len // context, kept, estimate, forward_peak, backward_peak)
