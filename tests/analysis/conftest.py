"""Tiny models with known depth behaviour, shared by the analysis tests."""

from __future__ import annotations

import pytest
import torch

from lnstrain.analysis.eval_data import windows_to_batches
from lnstrain.model import Transformer, model_preset
from lnstrain.parallel.groups import ParallelGroups
from tests.training.conftest import tiny_corpus  # noqa: F401  (a fixture, used by name)

VOCAB = 100


def tiny_model(num_layers: int = 4, groups: ParallelGroups | None = None, **overrides) -> Transformer:
    cfg = model_preset("tiny", num_layers=num_layers, num_heads=4, num_kv_heads=4, **overrides)
    return Transformer(cfg, groups or ParallelGroups.single_process())


@torch.no_grad()
def silence_layers(model: Transformer, keep: tuple[int, ...] = ()) -> Transformer:
    """Zero the output projections of every layer not in `keep`: those blocks become the identity."""
    for block in model.layers:
        if block.layer_number not in keep:
            block.attention.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
    return model


def token_windows(count: int = 8, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, seq_len + 1), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def batches():
    return windows_to_batches(token_windows(), batch_size=4)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The analysis tests' models are tiny: on a 2-core machine that is busy, torch's threads make their
    small matrix products many times slower than one thread does (the family test: 23 s on one thread
    against over 3 minutes with the default under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
