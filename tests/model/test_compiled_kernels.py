"""Compiled layers call the Triton kernels' custom ops, and compute what eager layers compute.

Every path of the transformer block is traced as ``train.compile`` traces it, with dynamo and
AOTAutograd and no kernel generation (the ``aot_eager`` backend, forward and backward graphs kept):
the custom ops ``lnstrain::rotate_qkv``/``swiglu`` (and their backward ops) appear in the graphs exactly
where a block's ``triton_kernel`` switches are on, plain torch ops where they are off, and the loss and
every gradient equal the eager model's bit for bit, for LNS and Pre-LN. On the CPU the ops run the eager
ops inside; in Triton's interpreter (``TRITON_INTERPRET=1``) they run the kernels, inside the compiled
graph as in eager.
"""

from __future__ import annotations

import os

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from lnstrain.model import Transformer, kernels, model_preset, rotary
from lnstrain.model.block import TransformerBlock
from lnstrain.model.build import TRITON_KERNELS, select_triton_kernels, set_fp8_mode, set_triton_kernel
from lnstrain.model.triton_common import triton
from lnstrain.parallel.groups import ParallelGroups

FORWARD_OPS = {"rotary": "lnstrain.rotate_qkv.default", "swiglu": "lnstrain.swiglu.default"}
BACKWARD_OPS = {"rotary": "lnstrain.rotate_qkv_backward.default", "swiglu": "lnstrain.swiglu_backward.default"}


def _recording_backend(graphs: dict[str, list[torch.fx.GraphModule]]):
    """``aot_eager`` that also keeps every forward and backward graph it was given."""
    def keep(kind: str):
        def compiler(graph: torch.fx.GraphModule, example_inputs):
            graphs[kind].append(graph)
            return make_boxed_func(graph.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def _targets(graphs: list[torch.fx.GraphModule]) -> set[str]:
    return {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"}


def _model(scheme: str, dtype: torch.dtype, switches: dict[str, bool]) -> Transformer:
    cfg = model_preset("tiny", norm_scheme=scheme, num_heads=4, num_kv_heads=2)
    model = Transformer(cfg, ParallelGroups.single_process()).to(dtype)
    for name, on in switches.items():
        set_triton_kernel(model, name, on)
    return model


def _loss_and_gradients(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _compare_compiled_with_eager(scheme: str, dtype: torch.dtype, switches: dict[str, bool]) -> None:
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = _loss_and_gradients(_model(scheme, dtype, switches), tokens)
    compiled = _model(scheme, dtype, switches)
    graphs: dict[str, list] = {"forward": [], "backward": []}
    torch._dynamo.reset()
    try:
        for block in compiled.modules():
            if isinstance(block, TransformerBlock):
                block.compile(backend=_recording_backend(graphs), fullgraph=True)
        loss, grads = _loss_and_gradients(compiled, tokens)
    finally:
        torch._dynamo.reset()
    assert graphs["forward"] and graphs["backward"]
    forward, backward = _targets(graphs["forward"]), _targets(graphs["backward"])
    for name, on in switches.items():
        assert (FORWARD_OPS[name] in forward) == on, (name, sorted(forward))
        assert (BACKWARD_OPS[name] in backward) == on, (name, sorted(backward))
    if not switches["swiglu"]:
        assert "aten.silu.default" in forward  # the plain ops, for inductor to fuse
    assert torch.equal(loss, eager_loss)
    for name, grad in eager_grads.items():
        assert torch.equal(grads[name], grad), name


SWITCH_SETTINGS = [{"rotary": True, "swiglu": True}, {"rotary": False, "swiglu": False},
                   {"rotary": True, "swiglu": False}, {"rotary": False, "swiglu": True}]


@pytest.mark.parametrize("switches", SWITCH_SETTINGS, ids=lambda s: ",".join(f"{k}={'on' if v else 'off'}" for k, v in s.items()))
@pytest.mark.parametrize("scheme", ["lns", "pre_ln"])
def test_compiled_blocks_call_the_custom_ops_where_switched_on_and_equal_eager(scheme, switches):
    _compare_compiled_with_eager(scheme, torch.float32 if scheme == "pre_ln" else torch.bfloat16, switches)


def test_the_custom_ops_and_the_plain_ops_give_the_same_bits_in_eager():
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(2))
    on = _loss_and_gradients(_model("lns", torch.bfloat16, {"rotary": True, "swiglu": True}), tokens)
    off = _loss_and_gradients(_model("lns", torch.bfloat16, {"rotary": False, "swiglu": False}), tokens)
    assert torch.equal(on[0], off[0])
    for name, grad in off[1].items():
        assert torch.equal(on[1][name], grad), name


def test_kernels_are_selected_only_where_they_run_and_pass_their_check(monkeypatch):
    model = _model("lns", torch.bfloat16, {"rotary": True, "swiglu": True})
    if triton is None or os.environ.get("TRITON_INTERPRET") != "1":  # the CPU: no kernel runs, plain ops to fuse
        assert select_triton_kernels(model, torch.device("cpu"), torch.bfloat16) == {"rotary": False, "swiglu": False}
        assert not any(m.triton_kernel for m in model.modules() if hasattr(m, "triton_kernel"))
    monkeypatch.setitem(TRITON_KERNELS, "rotary", (rotary.RotaryEmbedding, lambda device, dtype: True))
    monkeypatch.setitem(TRITON_KERNELS, "swiglu", (TRITON_KERNELS["swiglu"][0], lambda device, dtype: False))
    assert select_triton_kernels(model, torch.device("cpu"), torch.bfloat16) == {"rotary": True, "swiglu": False}
    assert all(m.triton_kernel for m in model.modules() if isinstance(m, rotary.RotaryEmbedding))
    assert not any(m.triton_kernel for m in model.modules() if isinstance(m, TRITON_KERNELS["swiglu"][0]))


@pytest.mark.skipif(triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton and TRITON_INTERPRET=1 (the kernels run in its CPU interpreter)")
def test_compiled_blocks_run_the_kernels_inside_their_graphs(monkeypatch):
    """In the interpreter the rotary kernel passes its check (its arithmetic is exact), and the SwiGLU
    check is taken as passed (the interpreter's exp is numpy's): compiled and eager both run the kernels."""
    calls = {"rotary": 0, "swiglu": 0}
    rotate_heads, swiglu_forward = rotary.rotary_kernel.rotate_heads, kernels.swiglu_kernel.forward

    def counted(name, function):
        def run(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(kernels, "swiglu_kernel_matches_eager", lambda device, dtype: True)
    monkeypatch.setattr(rotary.rotary_kernel, "rotate_heads", counted("rotary", rotate_heads))
    monkeypatch.setattr(kernels.swiglu_kernel, "forward", counted("swiglu", swiglu_forward))
    assert rotary.kernel_usable(torch.device("cpu"), torch.bfloat16)
    _compare_compiled_with_eager("lns", torch.bfloat16, {"rotary": True, "swiglu": True})
    assert calls["rotary"] > 0 and calls["swiglu"] > 0


@pytest.mark.parametrize("fp8", ["none", pytest.param("tensorwise", marks=pytest.mark.slow)])
def test_every_lns_layer_shares_one_compiled_graph_also_after_a_switch(fp8):
    """LNS's 1/√ℓ reaches compiled layers as a tensor input (``norms.OutputScale``), so layers 2..L share
    one graph and layer 1 (factor 1) another, before and after a kernel switch makes dynamo recompile:
    with the float, every layer got a graph of its own after the switch, past dynamo's recompile limit
    (the H100 call of 2026-11-28). The LNS factor switched to 1 (Pre-LN's norms) takes layer 1's graph.
    The same with float8 linears: their recipe is one object shared by every layer."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = model_preset("tiny", norm_scheme="lns", num_heads=4, num_kv_heads=2, num_layers=12)
    model = Transformer(cfg, ParallelGroups.single_process()).to(torch.bfloat16)
    set_fp8_mode(model, fp8, "cpu")  # the FP8 item of the GPU plan compiles this way
    blocks = [block for block in model.modules() if isinstance(block, TransformerBlock)]
    for block in blocks:
        block.compile(backend="aot_eager")
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))

    def graphs_after_a_step() -> int:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        return counters["stats"]["unique_graphs"]

    assert graphs_after_a_step() == 2
    for kernel in TRITON_KERNELS:
        set_triton_kernel(model, kernel, False)
    assert graphs_after_a_step() == 4
    factors = [(norm, norm.output_scale) for block in blocks for norm in (block.attention_norm, block.mlp_norm)]
    for norm, _ in factors:
        norm.output_scale = 1.0
    assert graphs_after_a_step() == 4
    for norm, factor in factors:
        norm.output_scale = factor
    assert graphs_after_a_step() == 4
    torch._dynamo.reset()
