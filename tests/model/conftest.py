from __future__ import annotations

import pytest
import torch

from lnstrain.model import ModelConfig, model_preset
from lnstrain.parallel.groups import ParallelGroups


@pytest.fixture
def single() -> ParallelGroups:
    return ParallelGroups.single_process()


@pytest.fixture
def tiny_cfg():
    """Factory: the tiny preset (hidden 32, 3 layers, vocab 100) with overrides."""
    def make(**overrides) -> ModelConfig:
        return model_preset("tiny", **overrides)
    return make


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
