"""Tensor (and sequence) parallel 2 on CPU/gloo against the single-process model, in fp32.

One spawn runs every case: building ranks is the slow part on a 2-core machine.
The parent un-shards each rank's gradients with the layers' own `unshard`, using a
same-shaped tp=2 model built with communication-free groups.
"""

from __future__ import annotations

import pytest
import torch

from lnstrain.model import Transformer, model_preset
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.testing.distributed import run_distributed

TP = 2
CASES = {  # name: (model overrides, sequence_parallel)
    "untied_kv_split": (dict(num_heads=4, num_kv_heads=2), False),
    "tied_kv_replicated": (dict(num_heads=4, num_kv_heads=1, tie_embeddings=True), False),
    "untied_kv_split_sp": (dict(num_heads=4, num_kv_heads=2, fused_qkv=False), True),
    "tied_kv_replicated_sp_layerscale": (dict(num_heads=4, num_kv_heads=1, tie_embeddings=True,
                                              norm_scheme="layerscale", layerscale_init=0.5), True),
    "kv_replicated_separate_sp_sandwich_layernorm": (dict(num_heads=4, num_kv_heads=1, fused_qkv=False,
                                                          norm_scheme="sandwich_ln", norm_type="layernorm"), True),
    "tied_kv_replicated_sp_lns_gain_init": (dict(num_heads=4, num_kv_heads=1, tie_embeddings=True,
                                                 norm_scheme="lns_gain_init"), True),
}


def make_cfg(overrides):
    return model_preset("tiny", **{"norm_scheme": "lns", "num_layers": 3, **overrides})


def batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 16), generator=generator)
    labels = torch.randint(0, 100, (2, 16), generator=generator)
    loss_mask = (torch.rand(2, 16, generator=generator) > 0.2).float()
    return tokens, labels, loss_mask


def tensor_parallel_worker(rank, world_size, cases):
    results = {}
    groups_by_sp = {sp: ParallelGroups.build(tensor=TP, pipeline=1, sequence_parallel=sp) for sp in (False, True)}
    for name, (overrides, sp) in cases.items():
        groups = groups_by_sp[sp]
        model = Transformer(make_cfg(overrides), groups)
        loss = model.loss(*batch())
        loss.backward()  # partial gradients (sequence-parallel norms, replicated KV heads) summed inside
        # numpy, not tensors: torch pickles tensors through shared memory that dies with the rank
        results[name] = (loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()})
    return results


def unshard_grads(cfg, per_rank_grads):
    """Full gradients from per-rank shards; replicated parameters must agree across ranks."""
    layout = Transformer(cfg, ParallelGroups(tp_size=TP, tp_rank=0))
    full = {}
    for name, _ in layout.named_parameters():
        owner = layout.get_submodule(name.rsplit(".", 1)[0])
        shards = [torch.from_numpy(grads[name]) for grads in per_rank_grads]
        if hasattr(owner, "unshard"):
            full[name] = owner.unshard(shards)
        else:
            torch.testing.assert_close(shards[1], shards[0], msg=f"replicated {name} differs across ranks")
            full[name] = shards[0]
    return full


@pytest.fixture(scope="module")
def parallel_results():
    return run_distributed(tensor_parallel_worker, TP, CASES, timeout_s=240)


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_match_single_process(case, parallel_results):
    overrides, _ = CASES[case]
    cfg = make_cfg(overrides)
    torch.manual_seed(0)
    reference = Transformer(cfg, ParallelGroups.single_process())
    reference_loss = reference.loss(*batch())
    reference_loss.backward()

    losses = [parallel_results[rank][case][0] for rank in range(TP)]
    assert losses == pytest.approx([reference_loss.item()] * TP, abs=1e-5)

    grads = unshard_grads(cfg, [parallel_results[rank][case][1] for rank in range(TP)])
    vocab = cfg.vocab_size
    for name, param in reference.named_parameters():
        expected, got = param.grad, grads[name]
        if "word_embeddings" in name or "head" in name:
            assert torch.all(got[vocab:] == 0), f"{name}: padded vocabulary got gradient"
            expected, got = expected[:vocab], got[:vocab]
        assert got.shape == expected.shape, name
        scale = expected.abs().max().clamp(min=1e-12)
        assert (got - expected).abs().max() / scale < 1e-5, name


def _counted(model, name):
    return getattr(model.get_parameter(name), "tensor_model_parallel", None)


@pytest.mark.parametrize("tp_rank, k_counted", [(0, True), (1, False), (2, True), (3, False)])
def test_gradient_norm_markers_count_each_weight_once(tp_rank, k_counted):
    """tp 4, 2 KV heads: each head is held by 2 ranks, and counted on the first of them."""
    cfg = make_cfg(dict(num_heads=4, num_kv_heads=2, fused_qkv=False))
    model = Transformer(cfg, ParallelGroups(tp_size=4, tp_rank=tp_rank))
    attention = "layers.0.attention"
    assert _counted(model, f"{attention}.k_proj.weight") is k_counted
    assert _counted(model, f"{attention}.v_proj.weight") is k_counted
    for sharded in (f"{attention}.q_proj.weight", f"{attention}.o_proj.weight", "layers.0.mlp.down_proj.weight",
                    "layers.0.mlp.gate_up_proj.weight", "embedding.word_embeddings.weight", "output.head.weight"):
        assert _counted(model, sharded) is True, sharded
    assert _counted(model, "layers.0.attention_norm.weight") is None  # replicated: tensor rank 0 counts it
    assert model.get_parameter(f"{attention}.o_proj.weight").partition_dim == 1
    fused = Transformer(make_cfg(dict(num_heads=4, num_kv_heads=2)), ParallelGroups(tp_size=4, tp_rank=tp_rank))
    assert _counted(fused, f"{attention}.qkv_proj.weight") is True  # mixed rows: see layout_problems


def test_markers_survive_meta_initialisation():
    from lnstrain.model import init_weights

    cfg = make_cfg(dict(num_heads=4, num_kv_heads=1, fused_qkv=False))
    with torch.device("meta"):
        model = Transformer(cfg, ParallelGroups(tp_size=2, tp_rank=1))
    model.to_empty(device="cpu")
    init_weights(model, cfg)
    assert _counted(model, "layers.0.attention.q_proj.weight") is True
    assert _counted(model, "layers.0.attention.k_proj.weight") is False
