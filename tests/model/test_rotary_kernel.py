"""The Triton rotary kernel (``lnstrain.model.rotary_kernel``) is bitwise the eager rotation of the
fused q|k|v projection, forward and backward.

Runs on CUDA, or on the CPU in Triton's interpreter (set before Python starts):

    TRITON_INTERPRET=1 python -m pytest tests/model/test_rotary_kernel.py

Skipped where Triton is not installed (CPU builds of torch) or neither applies.
"""

import os

import pytest
import torch

from lnstrain.model import rotary_kernel
from lnstrain.model.rotary import RotaryEmbedding, kernel_matches_eager

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    rotary_kernel.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton, and CUDA or TRITON_INTERPRET=1")


def _run(qkv: torch.Tensor, grads: list[torch.Tensor], rotary: RotaryEmbedding, q_heads: int, kv_heads: int,
         kernel: bool, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    monkeypatch.setattr(rotary_kernel, "supports", lambda x, cos: kernel)
    leaf = qkv.detach().clone().requires_grad_(True)
    outputs = rotary.fused_qkv(leaf, q_heads, kv_heads)
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs], leaf.grad


def _inputs(batch, seq, q_heads, kv_heads, head_dim, dtype, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(batch, seq, width, generator=generator) * scale).to(DEVICE, dtype)
    # gradients laid out as SDPA returns them, [batch, heads, seq, head_dim] in memory, seen as [b, s, h, d]
    grads = [(torch.randn(batch, heads, seq, head_dim, generator=generator) * scale).to(DEVICE, dtype).transpose(1, 2)
             for heads in (q_heads, kv_heads, kv_heads)]
    return qkv, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 8), (4, 2, 8), (36, 4, 12), (2, 1, 64)])
def test_kernel_is_bitwise_the_eager_rotation(dtype, q_heads, kv_heads, head_dim, monkeypatch):
    batch, seq = 2, 37
    rotary = RotaryEmbedding(head_dim, theta=10000.0)
    assert kernel_matches_eager(torch.device(DEVICE), dtype)  # else both runs below would be eager's
    for seed, scale in ((0, 1.0), (1, 300.0), (2, 1e-3)):
        qkv, grads = _inputs(batch, seq, q_heads, kv_heads, head_dim, dtype, scale, seed)
        eager, eager_grad = _run(qkv, grads, rotary, q_heads, kv_heads, False, monkeypatch)
        fused, fused_grad = _run(qkv, grads, rotary, q_heads, kv_heads, True, monkeypatch)
        for ours, reference in zip(fused, eager, strict=True):
            assert ours.shape == reference.shape
            assert torch.equal(ours, reference), (seed, (ours != reference).sum().item())
        assert torch.equal(fused_grad, eager_grad), (seed, (fused_grad != eager_grad).sum().item())
        assert qkv.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in fused}


def test_kernel_leaves_fp32_and_cpu_tensors_to_eager():
    cos = torch.ones(4, 1, 8)
    assert not rotary_kernel.supports(torch.zeros(1, 4, 2, 8), cos)  # fp32
    if os.environ.get("TRITON_INTERPRET") != "1":
        half = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
        assert not rotary_kernel.supports(half, cos.to(torch.bfloat16))  # a CPU tensor
