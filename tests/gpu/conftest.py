"""The device under test (CUDA; the CPU with LNSTRAIN_GPU_TESTS_DEVICE=cpu) and the session's tiny corpus."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.helpers import NO_CUDA_REASON, requested_device
from tests.training.conftest import tiny_corpus  # noqa: F401  (a fixture, used by name)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the suite tests: CUDA device 0, or the CPU when asked for; skips without CUDA.

    TF32 is off so that fp32 comparisons on CUDA mean fp32 (matmuls default to it off; cuDNN to on)."""
    if requested_device() == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA_REASON)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)
