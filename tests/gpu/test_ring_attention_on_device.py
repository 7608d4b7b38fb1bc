"""Ring attention's kernels on the device: FlashAttention's (they return the log-sum-exp) in bf16, the
fp32 reference otherwise, each against causal attention over the whole sequence in fp64.

The ring runs for 2 and 4 context ranks as threads of one process (``tests.parallel.virtual_ring``:
the ring's own forward and backward, its exchanges in memory), with grouped-query heads and the
model's layout ([batch, seq, heads, head_dim] memory seen as [batch, heads, seq, head_dim]). On CUDA
in bf16 the flash path must be the one taken: ``flash_matches_reference`` checked it against the
reference on the device first, and a failure there would leave training on the slow reference.
Tolerances are relative L2 errors: bf16 rounds each block's output and every input (8 significant
bits: 1e-3 to 1e-2), fp32 stays under 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lnstrain.parallel.attention_blocks import uses_flash
from tests.gpu.helpers import relative_error
from tests.parallel.virtual_ring import virtual_ring

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _model_layout(batch: int, seq: int, heads: int, head_dim: int, generator: torch.Generator,
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(batch, seq, heads, head_dim, generator=generator).to(device, dtype).transpose(1, 2)


@pytest.mark.gpu_core
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("size", [2, 4])
def test_ring_attention_matches_whole_sequence_attention(device, dtype, size, monkeypatch):
    generator = torch.Generator().manual_seed(size)
    batch, seq, heads, kv_heads, head_dim = 2, 256, 8, 2, 64
    q = _model_layout(batch, seq, heads, head_dim, generator, device, dtype)
    k, v = (_model_layout(batch, seq, kv_heads, head_dim, generator, device, dtype) for _ in range(2))
    grad = _model_layout(batch, seq, heads, head_dim, generator, device, dtype)
    assert uses_flash(q) == (device.type == "cuda" and dtype == torch.bfloat16)
    ring = virtual_ring(q, k, v, grad, size, monkeypatch)

    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True)
    out.backward(grad.double())
    for name, mine, reference in zip(("out", "dq", "dk", "dv"), ring, (out, *(t.grad for t in exact))):
        assert mine.dtype == dtype and mine.device.type == device.type, name
        assert relative_error(mine, reference) < TOLERANCE[dtype], (name, relative_error(mine, reference))
