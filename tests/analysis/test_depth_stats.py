"""The in-training collector: right values, nothing left behind, the same under every parallel layout."""

import math

import pytest
import torch
from torch import nn

from lnstrain.analysis.depth_stats import DepthStatsCollector, layer_profiles, stat_tag
from lnstrain.model import language_model_loss
from lnstrain.parallel.context import split_for_context
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.testing.distributed import run_distributed
from tests.analysis.conftest import silence_layers, tiny_model, token_windows

NUM_LAYERS = 4


def train_step(model, windows: torch.Tensor, micro_batches: int = 1) -> None:
    """Forward and backward of the mean loss over `windows`, split into micro-batches (DeepSpeed-style 1/n)."""
    for chunk in windows.chunk(micro_batches):
        (model.loss(chunk[:, :-1], chunk[:, 1:]) / micro_batches).backward()


def collect_stats(model, windows, groups=None, module=None, micro_batches=1, num_layers=NUM_LAYERS):
    collector = DepthStatsCollector(module or model, groups or ParallelGroups.single_process(), interval=5,
                                    num_layers=num_layers)
    collector.arm()
    train_step(model, windows, micro_batches)
    collector.read_parameter_grads()
    return collector.collect(step=5)


def manual_stats(model, windows) -> dict[str, float]:
    """The same statistics computed by hand, block by block, with torch.autograd.grad."""
    tokens, labels = windows[:, :-1], windows[:, 1:]
    hidden = model.embedding(tokens)
    records, outputs = [], []
    for block in model.layers:
        middle, out = block.sublayer_outputs(hidden)
        records.append((hidden, middle, out))
        outputs.append(out)
        hidden = out
    logits = model.output(hidden, model.embedding.word_embeddings.weight)
    loss = language_model_loss(logits, labels, model.cfg, model.groups)
    grads = torch.autograd.grad(loss, outputs)
    records = [tuple(t.detach() for t in record) for record in records]
    stats = {}
    for number, ((x, mid, out), grad) in enumerate(zip(records, grads), 1):
        stats[stat_tag("residual_variance", number, NUM_LAYERS)] = float(out.var(unbiased=False))
        stats[stat_tag("output_grad_norm", number, NUM_LAYERS)] = float(grad.norm())
        stats[stat_tag("attention_to_residual", number, NUM_LAYERS)] = float((mid - x).norm() / x.norm())
        stats[stat_tag("mlp_to_residual", number, NUM_LAYERS)] = float((out - mid).norm() / mid.norm())
    return stats


def assert_stats_close(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert sorted(actual) == sorted(expected)
    for tag, value in expected.items():
        assert actual[tag] == pytest.approx(value, rel=rtol, abs=1e-12), tag


def test_collector_matches_a_hand_computation():
    windows = token_windows(count=4)
    stats = collect_stats(tiny_model(NUM_LAYERS), windows)
    assert len(stats) == 5 * NUM_LAYERS and stat_tag("grad_norm", 3, NUM_LAYERS) == "depth/grad_norm/layer_03"
    expected = manual_stats(tiny_model(NUM_LAYERS), windows)
    assert_stats_close({tag: v for tag, v in stats.items() if "/grad_norm/" not in tag}, expected)


def test_parameter_grad_norm_is_the_norm_of_each_blocks_parameter_gradients():
    windows = token_windows(count=4)
    model = tiny_model(NUM_LAYERS)
    stats = collect_stats(model, windows)  # leaves the step's gradients in p.grad
    for block in model.layers:
        by_hand = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in block.parameters()))
        assert stats[stat_tag("grad_norm", block.layer_number, NUM_LAYERS)] == pytest.approx(by_hand, rel=1e-6)
    assert stats[stat_tag("grad_norm", 1, NUM_LAYERS)] != pytest.approx(stats[stat_tag("output_grad_norm", 1, NUM_LAYERS)])


def test_micro_batches_and_recomputation_do_not_change_the_stats():
    windows = token_windows(count=4)
    reference = collect_stats(tiny_model(NUM_LAYERS), windows)
    assert_stats_close(collect_stats(tiny_model(NUM_LAYERS), windows, micro_batches=2), reference)
    checkpointed = tiny_model(NUM_LAYERS)
    checkpointed.set_activation_checkpointing(True)
    assert_stats_close(collect_stats(checkpointed, windows), reference)


def test_identity_sublayers_contribute_nothing():
    stats = collect_stats(silence_layers(tiny_model(NUM_LAYERS)), token_windows(count=2))
    profiles = layer_profiles(stats)
    assert profiles["attention_to_residual"] == [0.0] * NUM_LAYERS == profiles["mlp_to_residual"]
    assert max(profiles["residual_variance"]) == pytest.approx(min(profiles["residual_variance"]), rel=1e-9)


def test_hooks_only_on_armed_steps():
    model = tiny_model(NUM_LAYERS)
    collector = DepthStatsCollector(model, ParallelGroups.single_process(), interval=3)
    assert [s for s in range(10) if collector.wants(s)] == [0, 3, 6, 9]
    assert not DepthStatsCollector(model, ParallelGroups.single_process(), interval=0).wants(0)
    collector.arm()
    assert collector.armed and any(block._forward_hooks for block in model.layers)
    train_step(model, token_windows(count=2))
    assert stat_tag("grad_norm", 1, NUM_LAYERS) not in collector.collect(3)  # parameter gradients not read
    assert not collector.armed
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match=r"no forward pass seen for layers \[1, 2, 3, 4\]"):
        collector.collect(4)


def test_tensorboard_scalars_and_layer_profile(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lnstrain.tracking.sinks import MetricSinks, TensorBoardSink
    from lnstrain.training.metrics import MetricsLogger

    stats = collect_stats(tiny_model(NUM_LAYERS), token_windows(count=2))
    metrics = MetricsLogger(10, 100, is_writer=True, sinks=MetricSinks([TensorBoardSink(tmp_path)]))
    metrics.record_depth_stats(stats, step=5)
    metrics.close()
    events = EventAccumulator(str(tmp_path)).Reload()
    assert set(events.Tags()["scalars"]) == set(stats)
    profile = events.Histograms("depth_profile/residual_variance")[0].histogram_value
    assert profile.bucket_limit == [1.5, 2.5, 3.5, 4.5]
    assert profile.bucket == pytest.approx(layer_profiles(stats)["residual_variance"])


# --- parallel layouts -------------------------------------------------------------------------

def _stats_under_layouts(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    windows = token_windows(count=4)
    results = {}
    for name, tensor, sequence_parallel in (("tp2", 2, False), ("tp2_sp", 2, True)):
        groups = ParallelGroups.build(tensor=tensor, pipeline=1, sequence_parallel=sequence_parallel)
        results[name] = collect_stats(tiny_model(NUM_LAYERS, groups), windows, groups)
    groups = ParallelGroups.build(tensor=1, pipeline=2)
    model = tiny_model(NUM_LAYERS, groups)  # every rank runs the whole model; the collector sees its stage only
    stage = nn.ModuleList(model.layers[:1] if groups.pp_rank == 0 else model.layers[1:])  # uneven split
    results["pp2"] = collect_stats(model, windows, groups, module=stage, num_layers=None)
    groups = ParallelGroups.build(tensor=1, pipeline=1)
    assert groups.dp_size == 2
    mine = windows[groups.dp_rank::2]
    results["dp2_zero2"] = _stats_under_zero2(tiny_model(NUM_LAYERS, groups), mine[:, :-1], mine[:, 1:], groups)
    groups = ParallelGroups.build(tensor=1, pipeline=1, context=2)  # each rank: two chunks of every window
    inputs, labels = (split_for_context(t, 1, groups) for t in (windows[:, :-1], windows[:, 1:]))
    results["cp2_zero2"] = _stats_under_zero2(tiny_model(NUM_LAYERS, groups), inputs, labels, groups)
    return results


def _stats_under_zero2(model, inputs, labels, groups) -> dict[str, float]:
    """Gradients reduced and partitioned by DeepSpeed's ZeRO-2 engine, read before its step."""
    import deepspeed

    from lnstrain.parallel.deepspeed_comm import init_deepspeed_comm

    init_deepspeed_comm("gloo")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), mpu=groups,
        config={"train_micro_batch_size_per_gpu": len(inputs), "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True})
    collector = DepthStatsCollector(model, groups, interval=5, num_layers=NUM_LAYERS)
    collector.arm()
    engine.backward(model.loss(inputs, labels))
    assert all(p.grad is None for p in model.layers.parameters())  # only ZeRO's partitions hold them
    collector.read_parameter_grads()
    return collector.collect(step=5)


@pytest.mark.multirank
def test_stats_are_independent_of_the_parallel_layout():
    reference = collect_stats(tiny_model(NUM_LAYERS), token_windows(count=4))
    per_rank = run_distributed(_stats_under_layouts, 2, timeout_s=240)
    for layout in ("tp2", "tp2_sp", "pp2", "dp2_zero2", "cp2_zero2"):
        assert per_rank[0][layout] == per_rank[1][layout]
        assert_stats_close(per_rank[0][layout], reference)
    assert all(math.isfinite(v) and v > 0 for v in reference.values())
