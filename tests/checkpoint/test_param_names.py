"""A saved pipeline's parameter names map to the single-process names through each layer's global layer
number, read from its spec by name: how the spec passes it (by position or keyword, in whatever order
the block's constructor takes it) does not matter."""

from __future__ import annotations

import pytest
from deepspeed.pipe import LayerSpec

from lnstrain.checkpoint.param_names import saved_pipeline_name_mapper
from lnstrain.model import ModelConfig
from lnstrain.model.block import TransformerBlock
from lnstrain.model import pipeline

CFG = ModelConfig(vocab_size=100, hidden_size=32, num_layers=3, num_heads=4, ffn_hidden_size=64, max_seq_len=16)
EXPECTED = {"0.word_embeddings.weight": "embedding.word_embeddings.weight",
            "1.attention.qkv_proj.weight": "layers.0.attention.qkv_proj.weight",
            "3.mlp_norm.weight": "layers.2.mlp_norm.weight",
            "4.head.weight": "output.head.weight"}


class LayerNumberFirstBlock(TransformerBlock):
    """A block whose constructor takes the layer number first."""

    def __init__(self, layer_number, cfg, groups) -> None:
        super().__init__(cfg, layer_number, groups)


def respec_blocks(monkeypatch, respec) -> None:
    """Make ``pipeline.layer_specs`` build each transformer layer's spec with ``respec(cfg, number, groups)``."""
    original = pipeline.layer_specs

    def layer_specs(cfg, groups):
        specs = original(cfg, groups)
        return [respec(*spec.module_args) if spec.typename is TransformerBlock else spec for spec in specs]

    monkeypatch.setattr(pipeline, "layer_specs", layer_specs)


@pytest.mark.parametrize("respec", [
    None,
    lambda cfg, number, groups: LayerSpec(TransformerBlock, groups=groups, layer_number=number, cfg=cfg),
    lambda cfg, number, groups: LayerSpec(LayerNumberFirstBlock, number, cfg, groups),
], ids=["as-built", "keywords", "reordered-constructor"])
def test_saved_pipeline_names_map_through_the_layer_number(respec, monkeypatch):
    if respec is not None:
        respec_blocks(monkeypatch, respec)
    mapper = saved_pipeline_name_mapper(CFG)
    assert {name: mapper(name) for name in EXPECTED} == EXPECTED
