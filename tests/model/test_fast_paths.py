"""The fast paths compute what the textbook expressions compute (bitwise, or within float rounding).

Fused-QKV rotary (one rotation over q|k, one gradient buffer) against the plain rotation of q and k
by autograd; RMSNorm against x * rsqrt(mean(x^2) + eps) * (w / sqrt(l)); the
one-rank cross-entropy (fused log-softmax) against the tensor-parallel form.
"""

import logging

import pytest
import torch

from lnstrain.model import kernels, rotary_kernel, swiglu_kernel
from lnstrain.model.norms import RMSNorm
from lnstrain.model.rotary import RotaryEmbedding, kernel_matches_eager, rotate


@pytest.mark.parametrize("triton_kernel", [True, False], ids=["custom op", "autograd function"])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_fused_qkv_rotary_is_bitwise_the_plain_rotation(q_heads, kv_heads, triton_kernel):
    batch, seq, head_dim = 2, 16, 8
    rotary = RotaryEmbedding(head_dim, theta=500.0)
    rotary.triton_kernel = triton_kernel
    qkv = torch.randn(batch, seq, (q_heads + 2 * kv_heads) * head_dim, requires_grad=True)
    grads = [torch.randn(batch, seq, heads, head_dim) for heads in (q_heads, kv_heads, kv_heads)]

    fused = rotary.fused_qkv(qkv, q_heads, kv_heads)
    torch.autograd.backward(fused, grads)
    fused_grad, qkv.grad = qkv.grad, None

    cos, sin = rotary.tables(seq, qkv.device, qkv.dtype)
    assert cos.shape == (seq, 1, head_dim)
    q, k, v = qkv.view(batch, seq, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=2)
    plain = rotate(q, cos, sin), rotate(k, cos, sin), v
    torch.autograd.backward(plain, grads)

    for ours, reference in zip(fused, plain):
        assert torch.equal(ours, reference)
    assert torch.equal(fused_grad, qkv.grad)
    buffers = {t.untyped_storage().data_ptr() for t in fused}
    assert qkv.untyped_storage().data_ptr() not in buffers  # the projection's output can be freed
    assert len(buffers) == (3 if triton_kernel else 1)  # a custom op's outputs cannot share a buffer


@pytest.mark.parametrize("failure", ["wrong bits", "raises"])
def test_a_rotary_kernel_that_fails_its_check_is_not_used(failure, monkeypatch, caplog):
    """A kernel that gives other bits than eager (or does not build) on the device is found by the
    once-per-device check and never used: the rotation is eager's, with a warning."""
    def bad_kernel(source, target, cos, sin, rotated_heads, backward=False):
        if failure == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        target.copy_(source)  # no rotation at all

    monkeypatch.setattr(rotary_kernel, "supports", lambda x, cos: x.dtype == torch.bfloat16)
    monkeypatch.setattr(rotary_kernel, "rotate_heads", bad_kernel)
    kernel_matches_eager.cache_clear()
    try:
        batch, seq, q_heads, kv_heads, head_dim = 2, 9, 4, 2, 8
        rotary = RotaryEmbedding(head_dim)
        qkv = torch.randn(batch, seq, (q_heads + 2 * kv_heads) * head_dim).to(torch.bfloat16).requires_grad_(True)
        with caplog.at_level(logging.WARNING, logger="lnstrain.model.rotary"):
            fused = rotary.fused_qkv(qkv, q_heads, kv_heads)
        cos, sin = rotary.tables(seq, qkv.device, qkv.dtype)
        q, k, v = qkv.detach().view(batch, seq, -1, head_dim).split([q_heads, kv_heads, kv_heads], dim=2)
        for ours, reference in zip(fused, (rotate(q, cos, sin), rotate(k, cos, sin), v)):
            assert torch.equal(ours, reference)
        assert not kernel_matches_eager(qkv.device, torch.bfloat16)
        assert "rotating with eager ops" in caplog.text
    finally:
        kernel_matches_eager.cache_clear()


@pytest.mark.parametrize("failure", ["wrong bits", "raises"])
def test_swiglu_kernels_that_fail_their_check_are_not_used(failure, monkeypatch, caplog):
    """Like the rotary kernel: SwiGLU kernels that give other bits than the eager ops (or do not build)
    are never used; the forward and gradients are the eager ops', with a warning."""
    def bad_forward(gate, up):
        if failure == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        return gate * up  # no silu

    monkeypatch.setattr(swiglu_kernel, "supports", lambda *tensors: tensors[0].dtype == torch.bfloat16)
    monkeypatch.setattr(swiglu_kernel, "forward", bad_forward)
    monkeypatch.setattr(swiglu_kernel, "backward", lambda grad_out, gate, up: (grad_out * up, grad_out * gate))
    kernels.swiglu_kernel_matches_eager.cache_clear()
    try:
        gate, up = (torch.randn(4, 96).to(torch.bfloat16).requires_grad_(True) for _ in range(2))
        with caplog.at_level(logging.WARNING, logger="lnstrain.model.kernels"):
            out = kernels.swiglu(gate, up)
        out.backward(torch.ones_like(out))
        plain_gate, plain_up = (t.detach().clone().requires_grad_(True) for t in (gate, up))
        plain = torch.nn.functional.silu(plain_gate) * plain_up
        plain.backward(torch.ones_like(plain))
        assert torch.equal(out, plain)
        assert torch.equal(gate.grad, plain_gate.grad) and torch.equal(up.grad, plain_up.grad)
        assert not kernels.swiglu_kernel_matches_eager(gate.device, torch.bfloat16)
        assert "using eager ops" in caplog.text
        if failure == "wrong bits":  # where they differ, for whoever fixes the kernel
            assert "out at gate=" in caplog.text and ": kernel " in caplog.text and ", eager " in caplog.text
    finally:
        kernels.swiglu_kernel_matches_eager.cache_clear()


def test_rotation_is_rotate_half():
    """Position p rotates the pair (i, i + d/2) by the angle p * theta^(-2i/d)."""
    head_dim, theta = 4, 100.0
    rotary = RotaryEmbedding(head_dim, theta)
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(1, 3, 1, head_dim)
    q, _ = rotary(x, x)
    angles = torch.arange(3.0)
    torch.testing.assert_close(q[0, :, 0, 0], angles.cos())
    torch.testing.assert_close(q[0, :, 0, 2], angles.sin())


def test_fused_and_separate_projections_give_the_same_attention(tiny_cfg, single):
    from lnstrain.model.attention import Attention
    from lnstrain.model.init import init_weights

    fused_cfg, separate_cfg = tiny_cfg(num_heads=4, num_kv_heads=2), tiny_cfg(num_heads=4, num_kv_heads=2,
                                                                                fused_qkv=False)
    fused, separate = Attention(fused_cfg, single), Attention(separate_cfg, single)
    init_weights(fused, fused_cfg)
    with torch.no_grad():
        q, k, v = fused.qkv_proj.weight.split(fused.qkv_proj.local_sizes)
        separate.q_proj.weight.copy_(q)
        separate.k_proj.weight.copy_(k)
        separate.v_proj.weight.copy_(v)
        separate.o_proj.weight.copy_(fused.o_proj.weight)
    x = torch.randn(2, 16, fused_cfg.hidden_size, requires_grad=True)
    fused(x).square().sum().backward()
    fused_grad, x.grad = x.grad, None
    separate(x).square().sum().backward()
    torch.testing.assert_close(fused_grad, x.grad, rtol=1e-5, atol=1e-6)
    separate_weight_grad = torch.cat([separate.q_proj.weight.grad, separate.k_proj.weight.grad,
                                      separate.v_proj.weight.grad])
    torch.testing.assert_close(fused.qkv_proj.weight.grad, separate_weight_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 3 ** -0.5])
def test_rms_norm_is_the_textbook_expression_with_the_factor_in_the_gain(scale):
    hidden, eps = 48, 1e-5
    norm = RMSNorm(hidden, eps, output_scale=scale)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    x = torch.randn(4, 16, hidden, requires_grad=True)
    grad = torch.randn_like(x)

    norm(x).backward(grad)
    ours = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    y = norm(x)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (norm.weight * scale)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)
    expected.backward(grad)
    torch.testing.assert_close(ours[0], x.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[1], norm.weight.grad, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("vocab_size", [48, 45])  # 45: the last 3 columns are padding
def test_one_rank_cross_entropy_equals_the_tensor_parallel_form(single, vocab_size):
    from lnstrain.parallel.cross_entropy import _VocabParallelCrossEntropy, vocab_parallel_cross_entropy

    logits = (4 * torch.randn(3, 8, 48)).requires_grad_()
    labels = torch.randint(0, vocab_size, (3, 8))
    weights = torch.rand(3, 8)
    fast = vocab_parallel_cross_entropy(logits, labels, single, vocab_size)
    (fast * weights).sum().backward()
    fast_grad, logits.grad = logits.grad, None
    general = _VocabParallelCrossEntropy.apply(logits, labels, single, vocab_size)
    (general * weights).sum().backward()
    torch.testing.assert_close(fast, general, rtol=0, atol=2e-6)
    torch.testing.assert_close(fast_grad, logits.grad, rtol=0, atol=3e-7)  # probabilities: ulps
    assert torch.all(fast_grad[..., vocab_size:] == 0)


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_each_cpu_attention_backend_trains_as_torchs_own_choice(backend):
    """model.attention_backend on the CPU: the named kernel runs, and loss and gradients are torch's
    default choice's within fp32 rounding (the kernels sum in different orders)."""
    from lnstrain.model import Transformer, model_preset
    from lnstrain.model.attention import sdpa_backends
    from lnstrain.parallel.groups import ParallelGroups
    from tests.gpu.helpers import OpRecorder

    results = {}
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    for choice in ("auto", backend):
        cfg = model_preset("tiny", norm_scheme="lns", attention_backend=choice)
        model = Transformer(cfg, ParallelGroups.single_process())
        for module in model.modules():
            if hasattr(module, "sdpa_backends"):
                assert module.sdpa_backends == sdpa_backends(choice, "cpu")
        with OpRecorder() as ops:
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        results[choice] = (loss.detach(), [p.grad.clone() for p in model.parameters()], ops)
    (auto_loss, auto_grads, _), (loss, grads, ops) = results["auto"], results[backend]
    flash_ran = ops.any_contains("_scaled_dot_product_flash_attention_for_cpu")
    assert flash_ran is (backend == "flash")
    torch.testing.assert_close(loss, auto_loss, rtol=1e-6, atol=1e-6)
    for grad, auto_grad in zip(grads, auto_grads):
        torch.testing.assert_close(grad, auto_grad, rtol=1e-4, atol=1e-6)
