"""The model's training-time modes on the device: activation checkpointing and torch.compile change how
a step is computed, never what it computes.

One forward and backward of a small LNS model (4 layers, grouped-query attention) in bf16 weights
(what DeepSpeed's bf16 engine runs) and in fp32. Recomputation repeats the same kernels on the same
inputs, so only non-deterministic reductions can differ (fp32: far under 1e-5; bf16: under 1e-2; both
exactly 0 on the CPU). Inductor fuses and reorders arithmetic: fp32 within 1e-4 (7e-7 measured on the
CPU), bf16 within 3e-2 (it keeps fused intermediates in fp32 where eager rounds each op to bf16, and
every gradient is itself rounded to bf16: 1e-2 measured on the CPU). A wrong result is off by order 1.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from lnstrain.model import Transformer, model_preset
from lnstrain.parallel.groups import ParallelGroups
from tests.gpu.helpers import relative_error

pytestmark = pytest.mark.gpu

SINGLE = ParallelGroups.single_process()
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
RECOMPUTE_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
COMPILE_TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def small_model(device: torch.device, dtype: torch.dtype) -> Transformer:
    cfg = model_preset("tiny", norm_scheme="lns", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=256, vocab_size=256, max_seq_len=64, make_vocab_size_divisible_by=64)
    return Transformer(cfg, SINGLE).to(device=device, dtype=dtype).train()  # the same seeded weights every time


def sample_tokens(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0)).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_gradients(model: Transformer, device: torch.device,
                       count_kept: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, every parameter's gradient, and (``count_kept``) the bytes autograd kept for backward
    during the forward (not under torch.compile, whose graphs keep their own tensors)."""
    kept = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    inputs, labels = sample_tokens(device)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor) if count_kept else nullcontext()
    with hooks:
        loss = model.loss(inputs, labels)
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}, kept


@DTYPES
def test_activation_checkpointing_modes_give_the_same_gradients(device, dtype):
    results = {}
    for mode in ("none", "selective", "full"):
        model = small_model(device, dtype)
        model.set_activation_checkpointing(mode)
        results[mode] = loss_and_gradients(model, device, count_kept=True)
    kept = {mode: result[2] for mode, result in results.items()}
    assert kept["none"] > kept["selective"] > kept["full"], kept  # each mode really keeps less

    loss, gradients, _ = results["none"]
    for mode in ("selective", "full"):
        assert relative_error(results[mode][0], loss) <= RECOMPUTE_TOLERANCE[dtype], mode
        for name, gradient in gradients.items():
            assert relative_error(results[mode][1][name], gradient) <= RECOMPUTE_TOLERANCE[dtype], (mode, name)


def host_to_device_copies(model: Transformer, device: torch.device) -> int:
    """Host-to-device copies the profiler sees in one forward and backward of ``model`` (0 on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiled:
        loss_and_gradients(model, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return sum(1 for event in profiled.events() if "Memcpy HtoD" in event.name)


@DTYPES
def test_compiled_layers_compute_what_eager_layers_compute(device, dtype):
    """Also: LNS's factors reach inductor as 0-dim CPU tensors (``norms.OutputScale``), so the 4 layers
    compile to 2 graphs (layer 1, factor 1; layers 2-4) and inductor passes the factor to its kernels
    as a scalar argument: a compiled step copies nothing more from the host than an eager one (a copy
    per norm from pageable memory would also make the host wait for the GPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_model = small_model(device, dtype)
    eager = loss_and_gradients(eager_model, device)
    compiled_model = small_model(device, dtype)
    for block in compiled_model.layers:  # as build_model does with train.compile
        block.compile()
    compiled = loss_and_gradients(compiled_model, device)
    graphs = counters["stats"]["unique_graphs"]
    copies = {"eager": host_to_device_copies(eager_model, device),
              "compiled": host_to_device_copies(compiled_model, device)}
    torch._dynamo.reset()
    assert graphs == 2  # the layers really ran compiled, layers 2-4 sharing one graph
    assert copies["compiled"] <= copies["eager"], copies
    assert relative_error(compiled[0], eager[0]) <= COMPILE_TOLERANCE[dtype]
    for name, gradient in eager[1].items():
        assert relative_error(compiled[1][name], gradient) <= COMPILE_TOLERANCE[dtype], name
