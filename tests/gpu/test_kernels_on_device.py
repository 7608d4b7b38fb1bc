"""The kernels a training step runs on the device: which one is chosen, and that it computes the formula.

* attention: SDPA on the model's 16-bit tensors picks a flash-style kernel by itself (flash, or cuDNN's
  where torch prefers it), with and without grouped-query attention, and lnstrain's ``Attention``
  (fused QKV, rotary, causal) on the flash kernel matches the same module's computation with SDPA's
  math kernel in fp64, forward and backward, and its attention core the causal softmax formula;
* RMSNorm with the LNS factor folded into its gain takes apex's or torch's fused kernel on CUDA
  (``kernels.rms_norm`` on the CPU), forward and backward against the plain formula in fp64;
* AdamW built by ``build_optimizer`` is the fused kernel, and five steps of it match torch's
  single-tensor AdamW in fp64.
* the Triton kernels of the fused q|k|v rotation and of SwiGLU give eager's bits on the device, so
  training uses them, and the benchmark's report says so.

Tolerances are relative L2 errors against fp64: bf16 arithmetic lands between 1e-3 and 1e-2 (8
significant bits), fp32 far under 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lnstrain.model import Transformer, init_weights, model_preset
from lnstrain.model.attention import Attention, sdpa_backends
from lnstrain.model.norms import TORCH_FUSED_RMS_NORM_ON_CUDA, RMSNorm, fused_rms_norm_affine
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.training.config import OptimConfig
from lnstrain.training.optimizer import build_optimizer
from tests.gpu.helpers import OpRecorder, relative_error

pytestmark = pytest.mark.gpu

SINGLE = ParallelGroups.single_process()
RELATIVE_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
ATTENTION_BF16_TOLERANCE = 2e-2
"""The attention module rounds to bf16 after each of its stages (QKV projection, rotary, SDPA, output
projection, and each gradient on the way back): 3e-3 to 6e-3 measured on the CPU, where a wrong mask,
rotation or head grouping is off by order 1."""


FUSED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")
"""The flash-style kernels SDPA may pick by itself for 16-bit causal attention (never the math or the
memory-efficient kernel, which are slower and keep more)."""


def attention_step(attention: Attention, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Output, input gradient and the aten ops run by one forward and backward (parameter grads accumulate)."""
    x = x.to(attention.o_proj.weight.device, copy=True).requires_grad_()
    with OpRecorder() as ops:
        out = attention(x)
        out.backward(grad.to(out.device))
    return out, x.grad, ops.names


def causal_attention_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d) + causal mask) v, each key/value head shared by its group of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seq = q.shape[-2]
    mask = torch.full((seq, seq), float("-inf"), dtype=q.dtype).triu(1)
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask, dim=-1) @ v


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_attention_takes_flash_and_matches_the_math_kernel_in_fp64(device, kv_heads):
    cfg = model_preset("tiny", hidden_size=512, num_heads=8, num_kv_heads=kv_heads, max_seq_len=256)
    attention = Attention(cfg, SINGLE)
    init_weights(attention, cfg)
    attention = attention.to(device=device, dtype=torch.bfloat16)  # what DeepSpeed's bf16 engine runs
    reference = copy.deepcopy(attention).to(device="cpu", dtype=torch.float64)  # the same bf16 weights, upcast
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, cfg.hidden_size, generator=generator).to(torch.bfloat16)
    grad = torch.randn(2, 256, cfg.hidden_size, generator=generator).to(torch.bfloat16)

    *_, chosen = attention_step(attention, x, grad)  # SDPA's own choice, as in training
    assert any(kernel in name for name in chosen for kernel in FUSED_ATTENTION), sorted(set(chosen))
    attention.zero_grad(set_to_none=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out, x_grad, ops = attention_step(attention, x, grad)
    flash = [name for name in ops if "_scaled_dot_product_flash_attention" in name]
    assert any("backward" not in name for name in flash) and any("backward" in name for name in flash), sorted(set(ops))

    q, k, v = (torch.randn(2, heads, 256, cfg.head_dim, generator=generator).to(torch.bfloat16)
               for heads in (cfg.num_heads, kv_heads, kv_heads))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        core = attention.core(*(t.to(device) for t in (q, k, v)))
    assert relative_error(core, causal_attention_formula(q.double(), k.double(), v.double())) <= RELATIVE_TOLERANCE[torch.bfloat16]

    x_reference = x.double().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        expected = reference(x_reference)
        expected.backward(grad.double())
    tolerance = ATTENTION_BF16_TOLERANCE
    assert relative_error(out, expected) <= tolerance
    assert relative_error(x_grad, x_reference.grad) <= tolerance
    for (name, param), (_, ref_param) in zip(attention.named_parameters(), reference.named_parameters()):
        assert relative_error(param.grad, ref_param.grad) <= tolerance, name


BACKEND_OPS = {"cudnn": ("_scaled_dot_product_cudnn_attention",),
               "flash": ("_scaled_dot_product_flash_attention",),  # ..._for_cpu on the CPU
               "efficient": ("_scaled_dot_product_efficient_attention",)}
"""The aten op (forward; its backward carries the same name) each ``model.attention_backend`` runs."""


def expected_attention_ops(backend: str, device: torch.device) -> tuple[str, ...]:
    if backend != "auto":
        return BACKEND_OPS[backend]
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return BACKEND_OPS["cudnn"]  # auto prefers cuDNN on Hopper
    return FUSED_ATTENTION  # elsewhere torch's own choice, a flash-style kernel


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=pytest.mark.gpu_core), "cudnn", "flash", "efficient"])
def test_the_configured_attention_kernel_runs_and_matches_the_math_kernel(device, backend):
    if device.type == "cpu" and backend in ("cudnn", "efficient"):
        pytest.skip(f"{backend} is a CUDA kernel (the pre-launch check refuses it on the CPU)")
    cfg = model_preset("tiny", hidden_size=512, num_heads=8, num_kv_heads=8, max_seq_len=256,
                       attention_backend=backend)
    attention = Attention(cfg, SINGLE)
    init_weights(attention, cfg)
    attention.sdpa_backends = sdpa_backends(backend, device.type)  # as build_model sets them for the device
    attention = attention.to(device=device, dtype=torch.bfloat16)
    reference = copy.deepcopy(attention).to(device="cpu", dtype=torch.float64)
    reference.sdpa_backends = sdpa_backends("math", "cpu")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, cfg.hidden_size, generator=generator).to(torch.bfloat16)
    grad = torch.randn(2, 256, cfg.hidden_size, generator=generator).to(torch.bfloat16)

    out, x_grad, ops = attention_step(attention, x, grad)
    ran = [name for name in ops if any(kernel in name for kernel in expected_attention_ops(backend, device))]
    assert any("backward" not in name for name in ran) and any("backward" in name for name in ran), sorted(set(ops))

    x_reference = x.double().requires_grad_()
    expected = reference(x_reference)
    expected.backward(grad.double())
    assert relative_error(out, expected) <= ATTENTION_BF16_TOLERANCE
    assert relative_error(x_grad, x_reference.grad) <= ATTENTION_BF16_TOLERANCE
    for (name, param), (_, ref_param) in zip(attention.named_parameters(), reference.named_parameters()):
        assert relative_error(param.grad, ref_param.grad) <= ATTENTION_BF16_TOLERANCE, name


def expected_rms_norm_kernel(device: torch.device) -> str:
    """What ``RMSNorm`` should run on ``device`` (same-dtype input and weight)."""
    if device.type != "cuda":
        return "lnstrain"
    if fused_rms_norm_affine is not None:
        return "apex"
    return "torch-fused" if TORCH_FUSED_RMS_NORM_ON_CUDA else "none"


@pytest.mark.gpu_core
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rms_norm_takes_a_fused_kernel_with_the_lns_factor_folded_in(device, dtype):
    hidden, eps, factor = 1024, 1e-5, 3 ** -0.5  # layer 3's LNS factor
    generator = torch.Generator().manual_seed(1)
    weight = 1 + 0.2 * torch.randn(hidden, generator=generator)
    x = (3 * torch.randn(4, 128, hidden, generator=generator) + 0.5).to(dtype)
    grad = torch.randn(4, 128, hidden, generator=generator).to(dtype)
    norm = RMSNorm(hidden, eps, output_scale=factor)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm = norm.to(device=device, dtype=dtype)

    kernel = expected_rms_norm_kernel(device)
    assert kernel != "none", "CUDA without apex and without torch's fused RMSNorm: RMSNorm would run unfused"
    x_device = x.to(device, copy=True).requires_grad_()
    with OpRecorder() as forward:
        y = norm(x_device)
    with OpRecorder() as backward:
        y.backward(grad.to(device))
    if kernel == "torch-fused":
        assert "aten::_fused_rms_norm" in forward.names and "aten::_fused_rms_norm_backward" in backward.names
    elif kernel == "lnstrain":  # kernels.rms_norm: its own forward (rsqrt of the mean square), never torch's
        assert "aten::rsqrt" in forward.names and not forward.any_contains("_fused_rms_norm")

    x64, w64 = x.double().requires_grad_(), norm.weight.detach().double().cpu().requires_grad_()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (w64 * factor)
    expected.backward(grad.double())
    tolerance = RELATIVE_TOLERANCE[dtype]
    assert relative_error(y, expected) <= tolerance
    assert relative_error(x_device.grad, x64.grad) <= tolerance
    assert relative_error(norm.weight.grad, w64.grad) <= tolerance


def test_adamw_is_fused_on_the_device_and_matches_the_single_tensor_reference(device):
    cfg = model_preset("tiny", num_layers=2)
    model = Transformer(cfg, SINGLE).to(device)
    optim = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1, beta2=0.95)
    optimizer = build_optimizer(model, optim)
    assert all(group.get("fused") for group in optimizer.param_groups), [g.get("fused") for g in optimizer.param_groups]

    copies = {param: param.detach().cpu().double().requires_grad_() for param in model.parameters()}
    reference = torch.optim.AdamW(
        [{"params": [copies[p] for p in group["params"]], "weight_decay": group["weight_decay"]}
         for group in optimizer.param_groups],
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False, fused=False)
    generator = torch.Generator().manual_seed(2)
    for _ in range(5):
        for param, copy_ in copies.items():
            gradient = torch.randn(param.shape, generator=generator, dtype=torch.float64) * 1e-2
            param.grad, copy_.grad = gradient.to(device=device, dtype=param.dtype), gradient
        optimizer.step()
        reference.step()
    for name, param in model.named_parameters():
        assert relative_error(param, copies[param]) <= RELATIVE_TOLERANCE[torch.float32], name


def test_the_triton_rotary_kernel_is_eagers_bitwise_and_used_on_the_device(device):
    """On CUDA with Triton, the fused q|k|v rotation's kernel passes its own check (eager's bits on a
    small case) in bf16 and fp16, so training uses it; the full comparison is tests/model/test_rotary_kernel.py."""
    from lnstrain.model import rotary_kernel
    from lnstrain.model.rotary import kernel_matches_eager

    if device.type != "cuda" or rotary_kernel.triton is None:
        pytest.skip("the Triton kernel runs on CUDA with Triton only")
    for dtype in (torch.bfloat16, torch.float16):
        assert kernel_matches_eager(device, dtype), dtype


def test_the_triton_swiglu_kernels_are_eagers_bitwise_and_used_on_the_device(device):
    """On CUDA with Triton, SwiGLU's kernels pass their own check (the eager ops' bits on 20,499 values
    from 1e-6 to ±100) in bf16 and fp16, so training uses them; the benchmark's report lists both
    kernels as used. The full comparison is tests/model/test_swiglu_kernel.py."""
    from lnstrain.benchmark.report import triton_kernels
    from lnstrain.model import kernels, swiglu_kernel

    if device.type != "cuda" or swiglu_kernel.triton is None:
        pytest.skip("the Triton kernels run on CUDA with Triton only")
    for dtype in (torch.bfloat16, torch.float16):
        assert kernels.swiglu_kernel_matches_eager(device, dtype), dtype
    assert triton_kernels(device, "bf16") == {"rotary": True, "swiglu": True}
    assert triton_kernels(device, "fp32") is None


def test_compiled_layers_run_the_triton_kernels_and_train_as_eager_ones(device, monkeypatch):
    """The default path on a GPU: ``select_triton_kernels`` keeps both kernels on, and layers compiled by
    inductor call them (as custom ops, forward and backward) and give eager's loss and gradients within
    bf16 rounding (inductor fuses the norms and residuals in its own order)."""
    from lnstrain.model import kernels, rotary
    from lnstrain.model.block import TransformerBlock
    from lnstrain.model.build import select_triton_kernels
    from lnstrain.parallel.groups import ParallelGroups

    if device.type != "cuda" or rotary.rotary_kernel.triton is None:
        pytest.skip("the Triton kernels run on CUDA with Triton only")
    calls = {"rotate_heads": 0, "forward": 0, "backward": 0}

    def counted(module, name):
        function = getattr(module, name)

        def run(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        monkeypatch.setattr(module, name, run)

    counted(rotary.rotary_kernel, "rotate_heads")
    counted(kernels.swiglu_kernel, "forward")
    counted(kernels.swiglu_kernel, "backward")
    tokens = torch.randint(0, 100, (2, 65), generator=torch.Generator().manual_seed(0)).to(device)
    results = []
    for compile_blocks in (False, True):
        torch.manual_seed(0)
        model = Transformer(model_preset("tiny", num_heads=4, num_kv_heads=2, hidden_size=64),
                            ParallelGroups.single_process()).to(device, torch.bfloat16)
        assert select_triton_kernels(model, device, torch.bfloat16) == {"rotary": True, "swiglu": True}
        if compile_blocks:
            for block in model.modules():
                if isinstance(block, TransformerBlock):
                    block.compile(backend="inductor")
        before = dict(calls)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        assert all(calls[name] > before[name] for name in calls), (compile_blocks, calls, before)
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-2, atol=1e-2)
    for name, grad in eager_grads.items():
        assert relative_error(compiled_grads[name], grad) <= 0.05, name
