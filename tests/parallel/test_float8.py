"""Float8 linear products (``lnstrain.parallel.float8``): what is cast to what, with which scales, the
numbers they give, and tensor- and context-parallel scales equal to the single process's.

Every scaled product is recorded on the CPU (the exact emulation of ``torch._scaled_mm`` that runs there,
itself checked against torch's CPU ``_scaled_mm`` where the build has one) and its operands are checked as
cuBLAS needs them on a GPU: the first row-major, the second column-major, every dimension a multiple of 16,
fp32 scales of shape () or [m, 1] and [1, n]. Dequantized, each operand is the tensor it
stands for within float8's rounding (relative 2^-4 for e4m3, 2^-3 for e5m2, plus the smallest subnormal
step). Against the bf16 product, the float8 layer's output and gradients differ by what that rounding
gives on random data, bounded here at a relative Frobenius error of 0.05 (e4m3) and 0.08 (e5m2
gradients, tensorwise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lnstrain.parallel import float8
from lnstrain.parallel.context import natural_order, split_for_context
from lnstrain.parallel.float8 import E4M3, E5M2, Float8Recipe, fits_float8, float8_linear
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.parallel.layers import ColumnParallelLinear, OutputPart, RowParallelLinear
from lnstrain.testing.distributed import run_distributed

M, K, N = 64, 96, 48
RECIPES = {name: float8.recipe_for(name, "cpu") for name in ("tensorwise", "rowwise")}
# (a dtype, b dtype) of the output, input-gradient and weight-gradient products
OPERAND_DTYPES = {"tensorwise": [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)],
                  "rowwise": [(E4M3, E4M3)] * 3}


def operands(dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, M // 2, K, generator=generator).to(dtype)
    weight = (0.05 * torch.randn(N, K, generator=generator)).to(dtype)
    grad = torch.randn(2, M // 2, N, generator=generator).to(dtype)
    return x, weight, grad


def forward_backward(product, x, weight, grad):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = product(x, weight)
    y.backward(grad)
    return y.detach(), x.grad, weight.grad


def recording_products(calls: list):
    """``float8._product`` recording (a, b, a's scale, b's scale) of every call before computing it."""
    product = float8._product

    def recording(a, b, a_scale, b_scale, *args, **kwargs):
        calls.append((a, b, a_scale.clone(), b_scale.clone()))
        return product(a, b, a_scale, b_scale, *args, **kwargs)

    return recording


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(float8, "_product", recording_products(calls))
    return calls


@pytest.mark.parametrize("name", RECIPES)
def test_each_product_casts_its_operands_as_the_recipe_says(recorded, name):
    x, weight, grad = operands()
    forward_backward(lambda x, w: float8_linear(x, w, RECIPES[name]), x, weight, grad)
    assert len(recorded) == 3
    x2, g2 = x.reshape(M, K).float(), grad.reshape(M, N).float()
    stands_for = [(x2, weight.float().t()), (g2, weight.float()), (g2.t(), x2)]  # output, grad_x, grad_w
    for (a, b, a_scale, b_scale), dtypes, (a_full, b_full) in zip(recorded, OPERAND_DTYPES[name], stands_for):
        assert (a.dtype, b.dtype) == dtypes
        assert a.is_contiguous() and b.t().is_contiguous()  # row-major a, column-major b (cuBLAS)
        assert all(size % 16 == 0 for size in (*a.shape, b.shape[1]))
        assert a_scale.dtype == b_scale.dtype == torch.float32
        if name == "rowwise":
            assert a_scale.shape == (a.shape[0], 1) and b_scale.shape == (1, b.shape[1])
            for scale in (a_scale, b_scale):  # powers of two: scaling is exact
                assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        else:
            assert a_scale.shape == b_scale.shape == ()
        for quantized, scale, full in ((a, a_scale, a_full), (b, b_scale, b_full)):
            half_ulp = torch.finfo(quantized.dtype).eps / 2
            tiny = torch.finfo(quantized.dtype).smallest_normal * torch.finfo(quantized.dtype).eps
            error = (quantized.float() / scale - full).abs()
            assert torch.all(error <= half_ulp * full.abs() + tiny / scale), (name, quantized.dtype)
        # the largest value of each scaled group reaches float8's top binade: the range is used
        largest = a.float().abs().amax(dim=1 if name == "rowwise" else None)
        assert torch.all(largest > torch.finfo(a.dtype).max / 2)


@pytest.mark.parametrize("name", RECIPES)
def test_float8_output_and_gradients_are_the_bf16_ones_within_float8_rounding(name):
    x, weight, grad = operands()
    reference = forward_backward(F.linear, x, weight, grad)
    ours = forward_backward(lambda x, w: float8_linear(x, w, RECIPES[name]), x, weight, grad)
    bounds = {"tensorwise": (0.05, 0.08, 0.08), "rowwise": (0.05, 0.05, 0.05)}[name]
    for actual, expected, bound in zip(ours, reference, bounds):
        assert actual.dtype == expected.dtype == torch.bfloat16
        relative = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
        assert 0 < relative < bound, (name, relative)


@pytest.mark.parametrize("name", RECIPES)
def test_the_exact_emulation_gives_the_scaled_products_numbers(name):
    """What runs off CUDA against torch's own CPU ``_scaled_mm`` (small shapes: its tensorwise CPU product is
    slow): the same bf16 results but where fp32 sums in another order round to the neighbouring bf16 value
    (one bf16 step)."""
    native_recipe = Float8Recipe(rowwise=name == "rowwise", emulate=False)
    a = torch.ones(16, 16).to(E4M3)
    scales = (torch.ones(16, 1), torch.ones(1, 16)) if name == "rowwise" else (torch.ones(()), torch.ones(()))
    try:
        torch._scaled_mm(a, a.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip(f"this torch build's CPU _scaled_mm has no {name} scaling (torch 2.11: tensorwise only)")
    x, weight, grad = operands()
    native = forward_backward(lambda x, w: float8_linear(x, w, native_recipe), x, weight, grad)
    emulated = forward_backward(lambda x, w: float8_linear(x, w, RECIPES[name]), x, weight, grad)
    assert RECIPES[name].emulate
    for a, b in zip(native, emulated):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)


def test_a_product_not_aligned_to_16_stays_in_bf16():
    layer = RowParallelLinear(40, 48, ParallelGroups.single_process(), name="down")
    torch.nn.init.normal_(layer.weight, std=0.05)
    layer.to(torch.bfloat16).fp8 = RECIPES["tensorwise"]
    x = torch.randn(4, 8, 40, dtype=torch.bfloat16)
    assert not fits_float8(x, layer.weight) and fits_float8(x[..., :32], layer.weight[:, :32])
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_the_recipes_by_device():
    assert float8.recipe_for("rowwise", "cpu") == Float8Recipe(rowwise=True, emulate=True)
    assert float8.recipe_for("tensorwise", "cuda") == Float8Recipe(rowwise=False, emulate=False)
    assert float8.recipe_for("none", "cuda") is None
    with pytest.raises(ValueError, match="tensorwise"):
        float8.recipe_for("blockwise", "cpu")


# --- tensor parallelism: the scales of the whole tensor on every shard ----------------------------------
HIDDEN, FFN = 32, 64


def mlp_pair(groups):
    """A column-parallel then a row-parallel layer (as the MLP's up and down), fp32, the same full
    weights at any tensor size."""
    up = ColumnParallelLinear(HIDDEN, [OutputPart("up", FFN, FFN)], groups)
    down = RowParallelLinear(FFN, HIDDEN, groups, name="down")
    generator = torch.Generator().manual_seed(3)
    full_up = 0.2 * torch.randn(FFN, HIDDEN, generator=generator)
    full_down = 0.2 * torch.randn(HIDDEN, FFN, generator=generator)
    # the second tensor rank's features 4× larger, so that a shard's own maxima would give other scales
    full_up[FFN // 2:] *= 4
    full_down[:, FFN // 2:] *= 4
    with torch.no_grad():
        up.weight.copy_(up.shard(full_up))
        down.weight.copy_(down.shard(full_down))
    return up, down


def run_pair(groups, name):
    """Output, input gradient and the two weight gradients (this rank's shards) of down(up(x)) in fp32, and
    the scales of its six float8 products in order (up, down; down's two gradients, up's two)."""
    calls = []
    product, float8._product = float8._product, recording_products(calls)
    try:
        return _run_pair(groups, name), [(a_scale, b_scale) for _, _, a_scale, b_scale in calls]
    finally:
        float8._product = product


def _run_pair(groups, name):
    up, down = mlp_pair(groups)
    for layer in (up, down):
        layer.fp8 = RECIPES[name] if name else None
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 32, HIDDEN, generator=generator)
    grad = torch.randn(2, 32, HIDDEN, generator=generator)
    # the late tokens 4× larger, so that the early chunks' own maxima would give other scales
    x[:, 16:] *= 4
    grad[:, 16:] *= 4
    x, grad = (split_for_context(t, 1, groups).contiguous() for t in (x, grad))  # this context rank's tokens
    x.requires_grad_()
    y = down(up(x))
    y.backward(grad)
    return y.detach(), x.grad, up.weight.grad, down.weight.grad


def _tensor_parallel_pair(rank, world_size, names):
    import types

    import torch.distributed as dist

    def numpy(run):
        tensors, scales = run
        return [t.numpy().copy() for t in tensors], [(a.numpy().copy(), b.numpy().copy()) for a, b in scales]

    groups = ParallelGroups.build(tensor=world_size, pipeline=1)
    context = ParallelGroups.build(tensor=1, pipeline=1, context=world_size)
    results = {name: numpy(run_pair(groups, name)) for name in names}
    results.update({f"{name} context": numpy(run_pair(context, name)) for name in names})
    sequence_parallel = ParallelGroups.build(tensor=world_size, pipeline=1, sequence_parallel=True)
    results["compiled"] = {(name, on): compiled_block_against_eager(name, layout, rank) for name in names
                           for on, layout in (("tensor", groups), ("sequence", sequence_parallel), ("context", context))}
    # the control: every rank scales its shards by their own maxima (the MAX all-reduces left out)
    float8.dist = types.SimpleNamespace(
        ReduceOp=dist.ReduceOp,
        all_reduce=lambda t, op=dist.ReduceOp.SUM, group=None: None if op == dist.ReduceOp.MAX else dist.all_reduce(
            t, op=op, group=group))
    results.update({f"{name} per shard": numpy(run_pair(groups, name)) for name in names})
    results.update({f"{name} context per shard": numpy(run_pair(context, name)) for name in names})
    return results


def shard_of(single: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """``single`` cut as ``local`` is along the one dimension where their sizes differ (none: whole)."""
    for dim, (whole, part) in enumerate(zip(single.shape, local.shape)):
        if whole != part:
            return single.narrow(dim, rank * part, part)
    return single


@pytest.fixture(scope="module")
def tensor_parallel_pairs():
    """Every rank's results of ``_tensor_parallel_pair`` (one 2-rank launch for the tensor and context tests)."""
    names = ["tensorwise", "rowwise"]
    return run_distributed(_tensor_parallel_pair, 2, names, timeout_s=240), names


@pytest.mark.multirank
def test_tensor_parallel_float8_equals_the_single_process_float8(tensor_parallel_pairs):
    """Two tensor ranks, fp32 activations so that only the summation order may differ: output and gradients
    within 1e-5 (relative Frobenius) of the single process's float8 results, and every scale of the six
    products the single process's (or its slice along the sharded dimension), for both recipes. The
    control, each shard scaled by its own maxima (the MAX all-reduces left out), has other scales, and with
    tensorwise scales misses by more than 1e-3. (Rowwise scales are powers of two, and multiplying by one
    does not change float8's relative rounding: a shard's own scales change results only where values
    fall out of float8's range, 2^15 below a row's maximum; so the scales themselves are compared.)"""
    by_rank, names = tensor_parallel_pairs
    layout = ParallelGroups(tp_size=2, tp_rank=0)
    up, down = mlp_pair(layout)
    for result in by_rank:  # compiled under tensor, sequence and context parallelism: one graph, eager's bits
        assert result["compiled"] == {(name, on): (1, 0, True) for name in names
                                      for on in ("tensor", "sequence", "context")}
    unfused, _ = run_pair(ParallelGroups.single_process(), None)
    for name in names:
        single, _ = run_pair(ParallelGroups.single_process(), name)
        assert ((single[0] - unfused[0]).norm() / unfused[0].norm()).item() > 1e-2  # float8 did round
        assert_single_process_products(
            by_rank, name, (name, f"{name} per shard"),
            lambda ranks: [ranks[0][0], ranks[0][1], up.unshard([r[2] for r in ranks]), down.unshard([r[3] for r in ranks])],
            shard_of)


def assert_single_process_products(by_rank: list, name: str, runs: tuple[str, str], assemble, scale_part) -> None:
    """``runs`` (with the MAX all-reduces, and the control without) against the single process's ``name`` pair:
    ``assemble`` makes the single process's output and gradients of the ranks' ones, ``scale_part(single,
    local, rank)`` cuts a single-process scale as the rank's is; with the all-reduces every scale is the
    single process's and the results within 1e-5, without them some scale differs and, tensorwise, the
    results miss by more than 1e-3."""
    single, single_scales = run_pair(ParallelGroups.single_process(), name)
    for run, same_scales in zip(runs, (True, False)):
        ranks = [[torch.from_numpy(t) for t in result[run][0]] for result in by_rank]
        errors = [((actual - expected).norm() / expected.norm()).item()
                  for actual, expected in zip(assemble(ranks), single)]
        matches = [torch.equal(scale_part(expected, torch.from_numpy(actual), rank), torch.from_numpy(actual))
                   for rank, result in enumerate(by_rank)
                   for pair, expected_pair in zip(result[run][1], single_scales)
                   for actual, expected in zip(pair, expected_pair)]
        assert len(matches) == 2 * 6 * 2
        if same_scales:
            assert all(matches) and max(errors) < 1e-5, (run, matches, errors)
        else:
            assert not all(matches), run
            assert name == "rowwise" or max(errors) > 1e-3, (run, errors)


def context_rows(single: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """``single``'s rows of context rank ``rank``'s tokens (of 2) where ``local`` has a row per token (rowwise
    scales along the tokens, [batch × sequence, 1]); ``single`` itself where their shapes agree."""
    if single.shape == local.shape:
        return single
    groups = ParallelGroups(cp_size=2, cp_rank=rank)
    return split_for_context(single.reshape(2, -1, single.shape[-1]), 1, groups).reshape(local.shape)


@pytest.mark.multirank
def test_context_parallel_float8_equals_the_single_process_float8(tensor_parallel_pairs):
    """Two context ranks, each with its two chunks of the tokens (the late ones 4× larger), fp32: output and
    input gradient (put back in sequence order) and the weight gradients (summed over the ranks, as data ×
    context reduction sums them) within 1e-5 of the single process's float8 results, and every scale of the
    six products the single process's (or its rows at this rank's tokens), for both recipes. The control,
    each rank scaled by the maxima of its own tokens, has other scales, and with tensorwise scales misses by
    more than 1e-3."""
    by_rank, names = tensor_parallel_pairs
    order = natural_order(2, 16)

    def in_sequence_order(ranks):
        joined = [torch.cat([r[index] for r in ranks], dim=1).index_select(1, order) for index in (0, 1)]
        return [*joined, sum(r[2] for r in ranks), sum(r[3] for r in ranks)]

    for name in names:
        assert_single_process_products(by_rank, name, (f"{name} context", f"{name} context per shard"),
                                       in_sequence_order, context_rows)


# --- the model: which layers, switched in place, compiled ---------------------------------------------
def test_set_fp8_mode_reaches_the_blocks_linears_only_and_switches_back():
    from lnstrain.model import Transformer, model_preset
    from lnstrain.model.build import set_fp8_mode
    from lnstrain.parallel.layers import ShardedWeightLayer

    model = Transformer(model_preset("tiny", num_layers=2), ParallelGroups.single_process())
    assert set_fp8_mode(model, "rowwise") == 2 * 4  # qkv, o, gate_up, down per block
    in_blocks = {id(m) for layer in model.layers for m in layer.modules()}
    for module in model.modules():
        if isinstance(module, ShardedWeightLayer):
            assert (module.fp8 == RECIPES["rowwise"]) is (id(module) in in_blocks), module
    assert model.output.head.fp8 is None and model.embedding.word_embeddings.fp8 is None
    set_fp8_mode(model, "none")
    assert all(getattr(module, "fp8", None) is None for module in model.modules())


def compiled_block_against_eager(name: str, groups, rank: int = 0) -> tuple[int, int, bool]:
    """(graphs, graph breaks, compiled == eager bit for bit) of a bf16 ``TransformerBlock`` with float8 linears
    compiled with the ``aot_eager`` backend (what inductor would receive), on ``groups``' tensor or context
    ranks (the ring an opaque operator, the scales' all-reduces functional collectives in the graph)."""
    import torch._dynamo

    from lnstrain.model import TransformerBlock, model_preset
    from lnstrain.model.build import set_fp8_mode

    block = TransformerBlock(model_preset("tiny", norm_scheme="lns", num_kv_heads=2), 2, groups).to(torch.bfloat16)
    set_fp8_mode(torch.nn.ModuleList([block]), name)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, 32, generator=generator).to(torch.bfloat16)
    grad = torch.randn(2, 16, 32, generator=generator).to(torch.bfloat16)
    if groups.sequence_parallel:
        x, grad = (t.chunk(groups.tp_size, dim=1)[rank].contiguous() for t in (x, grad))
    x, grad = (split_for_context(t, 1, groups).contiguous() for t in (x, grad))

    def step(fn):
        block.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        y = fn(inputs)
        y.backward(grad)
        return [y.detach(), inputs.grad, *(p.grad.clone() for p in block.parameters())]

    eager = step(block)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(x)
    compiled = step(torch.compile(block, backend="aot_eager"))
    return explanation.graph_count, explanation.graph_break_count, all(torch.equal(a, b) for a, b in zip(eager, compiled))


@pytest.mark.parametrize("name", RECIPES)
def test_a_compiled_block_traces_float8_into_one_graph_with_eagers_bits(name):
    """``train.compile`` with float8 linears: dynamo and AOTAutograd trace the whole block without a break
    and give eager's output and gradients (under tensor, sequence and context parallelism: the multi-rank
    test)."""
    assert compiled_block_against_eager(name, ParallelGroups.single_process()) == (1, 0, True)
