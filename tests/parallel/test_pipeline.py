"""The pipeline's layer specs, stage boundaries and loss, and the layout checks that run before any
process group or engine exists (single process; the multi-rank behaviour is in
test_layout_parity.py and test_layer_numbering.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lnstrain.config.feasibility import check_layout, layout_problems
from lnstrain.config.loader import ConfigError
from lnstrain.model import EmbeddingStage, OutputStage, TransformerBlock
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.model.pipeline import FinalNormStage, PipelineLoss, explicit_parts, layer_specs
from lnstrain.training.engine import build_engine
from tests.parallel.layouts import Layout, make_config

SINGLE = ParallelGroups.single_process()


def test_untied_specs_carry_global_layer_numbers():
    cfg = make_config(Layout("untied")).model
    specs = layer_specs(cfg, SINGLE)
    assert [s.typename for s in specs] == [EmbeddingStage] + [TransformerBlock] * 6 + [OutputStage]
    assert [s.module_args[1] for s in specs[1:-1]] == [1, 2, 3, 4, 5, 6]


def test_tied_specs_share_the_embedding_at_both_ends():
    cfg = make_config(Layout("tied", tied=True)).model
    specs = layer_specs(cfg, SINGLE)
    first, norm, last = specs[0], specs[-2], specs[-1]
    assert first.key == last.key and first.typename is last.typename is EmbeddingStage
    assert first.tied_weight_attr == last.tied_weight_attr == ["word_embeddings.weight"]
    assert first.forward_fn is None and last.forward_fn is not None
    assert norm.typename is FinalNormStage
    assert [s.module_args[1] for s in specs[1:-2]] == [1, 2, 3, 4, 5, 6]


def test_tied_pipeline_pieces_compute_the_single_process_logits():
    from lnstrain.model import Transformer
    from lnstrain.model.pipeline import tied_embedding_logits

    cfg = make_config(Layout("tied", tied=True)).model
    model = Transformer(cfg, SINGLE)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    pieces = [spec.build() for spec in layer_specs(cfg, SINGLE)]
    hidden = pieces[0](tokens)
    for piece in pieces[1:-1]:
        hidden = piece(hidden)
    logits = tied_embedding_logits(pieces[0], hidden)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("layers_per_stage, num_specs, expected", [
    ([2, 4], 8, [0, 3, 8]),           # untied: embedding + 6 layers + head
    ([2, 4], 9, [0, 3, 9]),           # tied: ... + final norm + tied logits
    ([1, 2, 2, 1], 8, [0, 2, 4, 6, 8]),
    ([3, 1, 1, 3], 10, [0, 4, 5, 6, 10]),
])
def test_explicit_boundaries_map_layer_counts_to_deepspeed_indices(layers_per_stage, num_specs, expected):
    assert explicit_parts(layers_per_stage, num_specs) == expected


def test_pipeline_loss_is_the_weighted_token_cross_entropy():
    cfg = make_config(Layout("untied")).model
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, cfg.padded_vocab_size(), generator=generator)
    logits[..., cfg.vocab_size:] = 50.0  # padded entries must not count
    labels = torch.randint(0, cfg.vocab_size, (2, 5), generator=generator)
    weights = torch.rand(2, 5, generator=generator)
    per_token = torch.nn.functional.cross_entropy(logits[..., :cfg.vocab_size].reshape(-1, cfg.vocab_size),
                                                  labels.reshape(-1), reduction="none")
    expected = (per_token * weights.reshape(-1)).sum()
    torch.testing.assert_close(PipelineLoss(cfg, SINGLE)(logits, (labels, weights)), expected)


def _config(layout: Layout, **changes):
    config = make_config(layout)
    for section, values in changes.items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    return config


@pytest.mark.parametrize("layout, changes, world_size, message", [
    (Layout("tp2_pp2", tensor=2, pipeline=2), {}, 6,
     "world size 6 is not divisible by parallel.tensor × parallel.pipeline (2 × 2)"),
    (Layout("tp3", tensor=3), {}, 3, "model.num_heads (4) must be divisible by parallel.tensor (3)"),
    (Layout("tp3", tensor=3), {}, 3, "model.num_kv_heads (2) must divide or be divisible by parallel.tensor (3)"),
    (Layout("pp4", pipeline=4), {"model": {"num_layers": 3}}, 4,
     "model.num_layers (3) is smaller than parallel.pipeline (4)"),
    (Layout("pp2_zero2", pipeline=2, zero_stage=2), {}, 2,
     "parallel.zero_stage 2 cannot be combined with pipeline parallelism"),
    (Layout("pp2_zero3", pipeline=2, zero_stage=3), {}, 2,
     "parallel.zero_stage 3 cannot be combined with pipeline parallelism"),
    (Layout("pp2", pipeline=2, boundaries=(2, 3)), {}, 2, "parallel.pipeline_boundaries sum to 5"),
    (Layout("fused_replicated_kv_zero1", tensor=2, zero_stage=1, kv_heads=1), {}, 2,
     "model.fused_qkv with model.num_kv_heads (1) < parallel.tensor (2) puts sharded query rows and "
     "replicated key/value rows in one parameter"),
    (Layout("fused_replicated_kv_bf16", tensor=2, kv_heads=1, dtype="bf16"), {}, 2,
     "Set model.fused_qkv: false (separate projections are counted exactly) or optim.grad_clip: 0"),
    (Layout("dp3"), {}, 3, "train.global_batch_size (8) must be divisible by"),
])
def test_layout_problems_name_the_key_and_fix(layout, changes, world_size, message):
    problems = layout_problems(_config(layout, **changes), world_size)
    assert any(message in problem for problem in problems), problems


def test_valid_layouts_have_no_problems():
    for layout, world_size in ((Layout("tp2_pp2", tensor=2, pipeline=2, zero_stage=1), 8),
                               (Layout("dp4_zero3", zero_stage=3), 4),
                               (Layout("sp_zero0", tensor=2, sequence_parallel=True), 2),
                               (Layout("sp_pp2_zero1_selective", tensor=2, pipeline=2, zero_stage=1,
                                       sequence_parallel=True, checkpointing="selective"), 4),
                               (Layout("sp_dp2_zero3_bf16", tensor=2, zero_stage=3, sequence_parallel=True,
                                       dtype="bf16"), 4),
                               (Layout("replicated_kv_zero2", tensor=2, zero_stage=2, kv_heads=1, fused_qkv=False), 2),
                               (Layout("fused_replicated_kv_zero0", tensor=2, kv_heads=1), 2)):
        assert layout_problems(layout.config(), world_size) == [], layout.name


def test_fused_replicated_kv_heads_are_fine_without_clipping():
    config = _config(Layout("fused_replicated_kv_zero1", tensor=2, zero_stage=1, kv_heads=1),
                     optim={"grad_clip": 0.0})
    assert layout_problems(config, 2) == []


def test_build_engine_fails_before_any_collective():
    """torch.distributed is not initialised here: the layout error must come first, not a hang."""
    config = make_config(Layout("pp2_zero3", pipeline=2, zero_stage=3))
    two_stages = ParallelGroups(pp_size=2)  # sizes only: building real groups would need torch.distributed
    with pytest.raises(ConfigError, match="zero_stage 3 cannot be combined with pipeline"):
        build_engine(config, two_stages)
    with pytest.raises(ConfigError):
        check_layout(make_config(Layout("tp2", tensor=2)), world_size=3)


def test_build_engine_rejects_groups_that_disagree_with_the_config():
    with pytest.raises(ValueError, match=r"process groups are \(tensor, pipeline, context, context method\) = \(1, 1, 1, .ring.\)"):
        build_engine(make_config(Layout("tp2", tensor=2)), SINGLE)
