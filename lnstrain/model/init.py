"""Deterministic weight initialisation, identical for every parallel layout.

Each weight is drawn in full on the CPU from a generator seeded by (seed, the weight's
name), e.g. "layer3.q", then cut to this rank's shard. Names come from the owning stage
(`init_prefix`: "embedding", "layer<l>", "output") and the layer's part names, so they
do not depend on module paths, pipeline splits or tensor parallelism.

Cost: every rank draws every full weight of the modules it owns, i.e. O(full layer) CPU
time and transient memory per rank. Fine at test and small scales; for large models build
on the meta device, materialise, and call `init_weights` on each rank's own stages.

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
    """A full [rows, cols] weight; vocabulary weights have zero rows past the true vocabulary."""
    real_rows = min(rows, cfg.vocab_size) if part_name in _VOCAB_PARTS else rows
    weight = torch.zeros(rows, cols)
    weight[:real_rows] = torch.randn(real_rows, cols, generator=_generator(seed, name)) * weight_std(cfg, part_name)
    return weight


def _init_layer(module: nn.Module, prefix: str, cfg: ModelConfig, seed: int) -> None:
    if any(p.is_meta for p in module.parameters(recurse=False)):
        return
    if isinstance(module, ColumnParallelLinear):
        full = torch.cat([_full_normal(cfg, seed, f"{prefix}.{p.name}", p.name, p.size, module.in_features)
                          for p in module.parts])
    elif isinstance(module, RowParallelLinear):
        full = _full_normal(cfg, seed, f"{prefix}.{module.name}", module.name,
                            module.out_features, module.in_features)
    elif isinstance(module, VocabParallelEmbedding):
        full = _full_normal(cfg, seed, f"{prefix}.embedding", "embedding",
                            module.padded_vocab_size, module.weight.shape[1])
    else:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        return
    module.weight.copy_(module.shard(full))
    module.mark_weight()


@torch.no_grad()
def init_weights(module: nn.Module, cfg: ModelConfig, seed: int | None = None, _prefix: str = "") -> None:
    """Initialise every parameter under `module` in place (a model, a stage or a layer).

    Parameters on the meta device are skipped: materialise first (`module.to_empty(device=...)`).
    `seed` defaults to cfg.init_seed.
    """
    seed = cfg.init_seed if seed is None else seed
    prefix = getattr(module, "init_prefix", _prefix)
    _init_layer(module, prefix, cfg, seed)
    for child in module.children():
        init_weights(child, cfg, seed, prefix)
