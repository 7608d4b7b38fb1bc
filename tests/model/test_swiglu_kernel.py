"""The Triton SwiGLU kernels (``lnstrain.model.swiglu_kernel``) compute what the eager ops compute,
forward and backward: bitwise on CUDA, which is what training requires before it uses them
(``kernels.swiglu_kernel_matches_eager``); within two roundings of the 16-bit dtype on a few elements in
Triton's CPU interpreter, whose ``exp`` is numpy's rather than CUDA's (a one-bit difference in fp32
decides a near-tie of the 16-bit rounding) and which flushes some subnormal results to zero.

    TRITON_INTERPRET=1 python -m pytest tests/model/test_swiglu_kernel.py

Skipped where Triton is not installed (CPU builds of torch) or neither CUDA nor the interpreter applies.
"""

import os

import pytest
import torch

from lnstrain.model import kernels, swiglu_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    swiglu_kernel.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs Triton, and CUDA or TRITON_INTERPRET=1")


def _values(count: int, scale: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, generator=generator) * scale).to(DEVICE, dtype)


def _assert_agrees(ours: torch.Tensor, eager: torch.Tensor) -> None:
    assert ours.shape == eager.shape and ours.dtype == eager.dtype
    if DEVICE == "cuda":
        assert torch.equal(ours, eager), int((ours != eager).sum())
        return
    info = torch.finfo(eager.dtype)
    differ = ours != eager
    ulp = info.eps * eager.float().abs().clamp_min(info.tiny)
    assert differ.float().mean() <= 1e-3, int(differ.sum())
    assert ((ours.float() - eager.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("count", [1, 1023, 1024, 5000])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 20.0])
def test_kernels_agree_with_the_eager_ops(dtype, count, scale):
    gate, up, grad_out = (_values(count, scale, seed, dtype) for seed in (0, 1, 2))
    _assert_agrees(swiglu_kernel.forward(gate, up), kernels._swiglu_eager(gate, up))
    ours = swiglu_kernel.backward(grad_out, gate, up)
    for got, expected in zip(ours, kernels._swiglu_backward_eager(grad_out, gate, up), strict=True):
        _assert_agrees(got, expected)


def test_the_self_check_passes_on_cuda():
    if DEVICE != "cuda":
        pytest.skip("the interpreter's exp is not CUDA's, so its bits are not expected to be eager's")
    for dtype in (torch.bfloat16, torch.float16):
        assert kernels.swiglu_kernel_matches_eager(torch.device(DEVICE), dtype)


def test_swiglu_runs_the_kernels_when_their_check_passes(monkeypatch):
    monkeypatch.setattr(kernels, "swiglu_kernel_matches_eager", lambda device, dtype: True)
    gate, up, grad_out = (_values(3 * 700, 1.0, seed, torch.bfloat16).view(3, 700) for seed in (3, 4, 5))
    leaves = [t.clone().requires_grad_(True) for t in (gate, up)]
    out = kernels.swiglu(*leaves)
    out.backward(grad_out)
    assert torch.equal(out.detach(), swiglu_kernel.forward(gate, up))
    for leaf, expected in zip(leaves, swiglu_kernel.backward(grad_out, gate, up), strict=True):
        assert torch.equal(leaf.grad, expected)
    assert not swiglu_kernel.supports(gate, up.t().contiguous().t())  # a strided operand: the eager ops
    assert not swiglu_kernel.supports(gate[:0], up[:0])  # nothing to launch
