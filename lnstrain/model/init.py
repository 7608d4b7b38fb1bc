"""Deterministic weight initialisation, identical for every parallel layout.

Each weight is drawn in full on the CPU from a generator seeded by (seed, the weight's
name), e.g. "layer3.q", then cut to this rank's shard. Names come from the owning stage
(`init_prefix`: "embedding", "layer<l>", "output") and the layer's part names, so they
do not depend on module paths, pipeline splits or tensor parallelism.

Cost: every rank draws every full weight of the modules it owns, i.e. O(full layer) CPU
time and transient memory per rank. The weights of one call are drawn concurrently, on as many
threads as torch's intra-op setting (each draw has its own generator, so the numbers do not depend
on the thread count); the 1.36B-parameter 1B model takes seconds on a 16-core host. For larger models
build on the meta device, materialise, and call `init_weights` on each rank's own stages.

Standard deviations: normal(0, init_std) everywhere; output projections (o, down) are
divided by sqrt(2 * num_layers) when `scaled_init`; under DeepNorm the v, o, gate, up and
down weights are multiplied by beta = (8N)^(-1/4) (DeepNet's decoder-only rule, applied to
our normal init instead of Xavier). Padded vocabulary rows are zero. Norm gains are one (under
`lns_gain_init` the pre-sublayer gains of layer l start at 1/sqrt(l) instead),
biases zero, LayerScale gains their initial value.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.norm_schemes import deepnorm_beta
from lnstrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

_RESIDUAL_OUTPUTS = {"o", "down"}
_DEEPNORM_SCALED = {"v", "o", "gate", "up", "down"}
_VOCAB_PARTS = {"embedding", "vocab"}


def weight_std(cfg: ModelConfig, part_name: str) -> float:
    """Standard deviation of the normal init of the weight part `part_name`."""
    std = cfg.init_std
    if cfg.scaled_init and part_name in _RESIDUAL_OUTPUTS:
        std /= math.sqrt(2 * cfg.num_layers)
    if NormScheme(cfg.norm_scheme) == NormScheme.DEEPNORM and part_name in _DEEPNORM_SCALED:
        std *= deepnorm_beta(cfg.num_layers)
    return std


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _full_normal(cfg: ModelConfig, seed: int, name: str, part_name: str, rows: int, cols: int) -> torch.Tensor:
    """A full [rows, cols] weight; vocabulary weights have zero rows past the true vocabulary.
    (``normal_(0, std)`` is bitwise ``randn() * std``, in one pass instead of three.)"""
    real_rows = min(rows, cfg.vocab_size) if part_name in _VOCAB_PARTS else rows
    weight = torch.zeros(rows, cols) if real_rows < rows else torch.empty(rows, cols)
    weight[:real_rows].normal_(0.0, weight_std(cfg, part_name), generator=_generator(seed, name))
    return weight


_DRAWN = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _interposed() -> bool:
    """Whether a dispatch or function mode is active on this thread (fake tensors, a memory tracker): its
    tensors and records are the calling thread's, so the weights must be drawn there."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled()


def _draw_layer(module: nn.Module, prefix: str, cfg: ModelConfig, seed: int) -> None:
    """Draw a tensor-parallel layer's full weight and keep this rank's shard."""
    if isinstance(module, ColumnParallelLinear):
        full = torch.cat([_full_normal(cfg, seed, f"{prefix}.{p.name}", p.name, p.size, module.in_features)
                          for p in module.parts])
    elif isinstance(module, RowParallelLinear):
        full = _full_normal(cfg, seed, f"{prefix}.{module.name}", module.name,
                            module.out_features, module.in_features)
    elif isinstance(module, VocabParallelEmbedding):
        full = _full_normal(cfg, seed, f"{prefix}.embedding", "embedding",
                            module.padded_vocab_size, module.weight.shape[1])
    with torch.no_grad():
        module.weight.copy_(module.shard(full))
    module.mark_weight()


def _layers_to_draw(module: nn.Module, prefix: str, found: list[tuple[nn.Module, str]]) -> None:
    """Reset every parameter under ``module`` that is not drawn; list the (layer, name prefix) that are."""
    prefix = getattr(module, "init_prefix", prefix)
    if not any(p.is_meta for p in module.parameters(recurse=False)):
        if isinstance(module, _DRAWN):
            found.append((module, prefix))
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for child in module.children():
        _layers_to_draw(child, prefix, found)


@torch.no_grad()
def init_weights(module: nn.Module, cfg: ModelConfig, seed: int | None = None) -> None:
    """Initialise every parameter under `module` in place (a model, a stage or a layer).

    Parameters on the meta device are skipped: materialise first (`module.to_empty(device=...)`).
    `seed` defaults to cfg.init_seed.
    """
    seed = cfg.init_seed if seed is None else seed
    layers: list[tuple[nn.Module, str]] = []
    _layers_to_draw(module, "", layers)
    threads = min(len(layers), torch.get_num_threads())
    if threads <= 1 or _interposed():
        for layer, prefix in layers:
            _draw_layer(layer, prefix, cfg, seed)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="init_weights") as pool:
        for done in [pool.submit(_draw_layer, layer, prefix, cfg, seed) for layer, prefix in layers]:
            done.result()
