"""``kernels.rms_norm`` and ``kernels.swiglu``: torch's numbers, less kept for backward.

Forward is bitwise ``F.rms_norm`` / ``F.silu(g) * u`` in every dtype; RMSNorm's gradients pass
``gradcheck`` in fp64 and match an fp64 reference to bf16 rounding; SwiGLU's gradients are bitwise
autograd's. What each keeps for backward is counted through ``saved_tensors_hooks``.
"""

import pytest
import torch
import torch.nn.functional as F

from lnstrain.model.kernels import rms_norm, swiglu


def saved_bytes(fn, *inputs) -> int:
    """Bytes of distinct storages autograd keeps for ``fn(*inputs)``'s backward, inputs excluded."""
    exclude = {t.untyped_storage().data_ptr() for t in inputs}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_forward_is_bitwise_torchs(dtype):
    x = torch.randn(3, 5, 48, dtype=dtype) * 3
    gain = (1 + 0.2 * torch.randn(48)).to(dtype)
    assert torch.equal(rms_norm(x, gain, 1e-5), F.rms_norm(x, (48,), gain, 1e-5))


def test_rms_norm_scale_is_the_gain_times_a_constant():
    """LNS's 1/sqrt(l) inside the function: the same numbers as scaling the weight outside it."""
    x = torch.randn(3, 5, 48, requires_grad=True)
    weight = (1 + 0.2 * torch.randn(48)).requires_grad_()
    grad = torch.randn(3, 5, 48)
    inside = rms_norm(x, weight, 1e-5, 0.5**0.5)
    inside_grads = torch.autograd.grad(inside, (x, weight), grad)
    outside = rms_norm(x, weight * 0.5**0.5, 1e-5)
    outside_grads = torch.autograd.grad(outside, (x, weight), grad)
    assert torch.equal(inside, outside) and torch.equal(inside, F.rms_norm(x, (48,), weight * 0.5**0.5, 1e-5))
    for a, b in zip(inside_grads, outside_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_rms_norm_gradients_pass_gradcheck():
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    gain = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, g: rms_norm(a, g, 1e-5), (x, gain))
    assert torch.autograd.gradcheck(lambda a, g: rms_norm(a, g, 1e-5, 0.3), (x, gain))


def test_rms_norm_bf16_gradients_match_fp64_to_rounding():
    x64 = torch.randn(4, 32, 64, dtype=torch.float64)
    gain64 = 1 + 0.1 * torch.randn(64, dtype=torch.float64)
    grad64 = torch.randn(4, 32, 64, dtype=torch.float64)
    x, gain = x64.to(torch.bfloat16).requires_grad_(), gain64.to(torch.bfloat16).requires_grad_()
    reference = [t.detach().requires_grad_() for t in (x.double(), gain.double())]
    torch.autograd.backward(rms_norm(x, gain, 1e-5), grad64.to(torch.bfloat16))
    torch.autograd.backward(rms_norm(*reference, 1e-5), grad64.to(torch.bfloat16).double())
    torch.testing.assert_close(x.grad.double(), reference[0].grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gain.grad.double(), reference[1].grad, rtol=1e-2, atol=1e-1)


def test_rms_norm_keeps_only_its_input_and_the_row_statistic():
    x = torch.randn(8, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    gain = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda a, g: rms_norm(a, g, 1e-5), x, gain) == 8 * 16 * 4  # fp32 rstd per row
    unfused = saved_bytes(lambda a, g: F.rms_norm(a, (64,), g, 1e-5), x, gain)
    assert unfused >= 2 * x.numel() * 4  # torch's CPU path: fp32 copies of the activation


def test_swiglu_is_bitwise_autograds_and_keeps_no_silu_output():
    gate = torch.randn(6, 40, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(6, 40, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(6, 40, dtype=torch.bfloat16)
    ours = swiglu(gate, up)
    ours_grads = torch.autograd.grad(ours, (gate, up), grad)
    plain = F.silu(gate) * up
    assert torch.equal(ours, plain)
    for a, b in zip(ours_grads, torch.autograd.grad(plain, (gate, up), grad)):
        assert torch.equal(a, b)
    assert saved_bytes(swiglu, gate, up) == 0
    assert saved_bytes(lambda g, u: F.silu(g) * u, gate, up) == gate.numel() * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_traced_kernels_give_eagers_outputs_and_gradients_bitwise(dtype, scale):
    """What torch.compile's autograd tracing makes of both functions, without generating kernels
    (``aot_eager``). torch 2.11 traced an autograd.Function whose forward returned the result of an
    in-place op, or of a same-dtype ``.to``, into one whose gradients were all zero (fp32 RMSNorm)."""
    torch._dynamo.reset()
    x0, up0 = torch.randn(2, 8, 32, dtype=dtype), torch.randn(2, 8, 32, dtype=dtype)
    gain0, grad = (1 + 0.2 * torch.randn(32)).to(dtype), torch.randn(2, 8, 32, dtype=dtype)

    def step(fn):
        x, gain, up = (t.clone().requires_grad_() for t in (x0, gain0, up0))
        out = fn(x, gain, up)
        out.backward(grad)
        return out.detach(), x.grad, gain.grad, up.grad

    def both(x, gain, up):
        return swiglu(rms_norm(x, gain, 1e-5, scale), up)

    eager = step(both)
    traced = step(torch.compile(both, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    for name, got, want in zip(("output", "x", "gain", "up"), traced, eager):
        assert torch.equal(got, want), name
