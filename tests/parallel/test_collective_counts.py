"""The collectives one transformer layer issues, against Megatron's numbers.

Without sequence parallelism: 2 all-reduces forward (attention and MLP outputs) and 2
backward (their inputs' gradients). With it: 2 all-gathers + 2 reduce-scatters forward,
and the mirror backward, plus one all-reduce that sums the norm (and LayerScale) gains'
partial gradients, however many gains the layer has (Megatron also all-reduces them, once per
step over all layers). A KV head replicated over the tensor ranks adds one all-reduce backward
(its rows of the fused QKV gradient).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from lnstrain.model import TransformerBlock, model_preset
from lnstrain.parallel import mappings
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.testing.distributed import run_distributed

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all")


def count_collectives(counts: Counter) -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counting)


CASES = {  # name: (sequence parallel, model overrides)
    "tp": (False, dict(norm_scheme="lns", num_kv_heads=2)),
    "sp": (True, dict(norm_scheme="lns", num_kv_heads=2)),
    "sp_sandwich_layernorm": (True, dict(norm_scheme="sandwich_ln", norm_type="layernorm", num_kv_heads=2)),
    "sp_layerscale": (True, dict(norm_scheme="layerscale", num_kv_heads=2)),
    "tp_replicated_kv": (False, dict(norm_scheme="lns", num_kv_heads=1)),
}
SP_FORWARD = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}


def collective_worker(rank, world_size):
    counts = Counter()
    count_collectives(counts)
    results = {}
    for case, (sp, overrides) in CASES.items():
        groups = ParallelGroups.build(tensor=2, pipeline=1, sequence_parallel=sp)
        block = TransformerBlock(model_preset("tiny", **overrides), 3, groups)
        seq = 16 // 2 if sp else 16
        x = torch.randn(2, seq, 32, requires_grad=True)
        counts.clear()
        out = block(x)
        forward = dict(counts)
        counts.clear()
        out.sum().backward()
        results[case] = (forward, dict(counts))

    # the mappings' round trips
    groups = ParallelGroups.build(tensor=2, pipeline=1, sequence_parallel=True)
    full = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)
    shard = mappings.scatter_to_tp(full, groups)
    assert torch.equal(shard, full[..., rank * 3:(rank + 1) * 3])
    assert torch.equal(mappings.gather_from_tp(shard, groups), full)
    shard = mappings.scatter_to_sequence_parallel(full, groups)
    assert torch.equal(shard, full[:, rank * 2:(rank + 1) * 2])
    assert torch.equal(mappings.gather_from_sequence_parallel(shard, groups), full)
    summed = mappings.reduce_scatter_to_sequence_parallel(full * (rank + 1), groups)
    assert torch.equal(summed, 3 * full[:, rank * 2:(rank + 1) * 2])
    assert torch.equal(mappings.reduce_from_tp(full.clone() * (rank + 1), groups), 3 * full)
    return results


@pytest.mark.multirank
def test_collectives_per_layer_match_megatron():
    expected = {
        "tp": ({"all_reduce": 2}, {"all_reduce": 2}),
        "sp": (SP_FORWARD, {**SP_FORWARD, "all_reduce": 1}),
        "sp_sandwich_layernorm": (SP_FORWARD, {**SP_FORWARD, "all_reduce": 1}),  # 4 norms, weight + bias
        "sp_layerscale": (SP_FORWARD, {**SP_FORWARD, "all_reduce": 1}),  # 2 norms + 2 gains
        "tp_replicated_kv": ({"all_reduce": 2}, {"all_reduce": 3}),
    }
    for rank_results in run_distributed(collective_worker, 2, timeout_s=120):
        assert rank_results == expected
