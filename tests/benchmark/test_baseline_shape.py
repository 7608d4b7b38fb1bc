"""The Hugging Face baseline has lnstrain's shape; LNS does not multiply torch.compile's graphs."""

import pytest
import torch

from lnstrain.model.block import TransformerBlock
from lnstrain.model.presets import model_preset
from lnstrain.model.transformer import Transformer
from lnstrain.parallel.groups import ParallelGroups

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [True, False])
def test_hf_baseline_has_the_same_parameter_shapes(tied):
    from lnstrain.benchmark.hf_baseline import build_hf_model

    cfg = model_preset("tiny", tie_embeddings=tied, norm_scheme="lns")
    ours = Transformer(cfg, ParallelGroups.single_process())
    theirs = build_hf_model(cfg)
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())
    assert theirs.config.vocab_size == cfg.padded_vocab_size(1)
    assert theirs.config._attn_implementation == "sdpa"


def test_hf_baseline_refuses_schemes_llama_lacks():
    from lnstrain.benchmark.hf_baseline import BaselineUnavailable, llama_config_kwargs

    with pytest.raises(BaselineUnavailable, match="post_ln"):
        llama_config_kwargs(model_preset("tiny", norm_scheme="post_ln"))


@pytest.mark.slow
def test_lns_compiles_to_two_graphs_not_one_per_layer():
    """The 1/sqrt(l) factors are floats torch.compile does not specialise on: layer 1 (factor 1.0,
    no multiply) and one graph for every other layer; Pre-LN is one graph. Three steps with inductor:
    a recompilation (once caused by the rotary cache's state) is where inductor specialised on the
    float, one graph per layer, which hits dynamo's recompile limit in a deep model."""
    from torch._dynamo.utils import counters

    graphs = {}
    for scheme in ("pre_ln", "lns"):
        torch._dynamo.reset()
        counters.clear()
        model = Transformer(model_preset("tiny", num_layers=6, norm_scheme=scheme), ParallelGroups.single_process())
        for block in model.modules():
            if isinstance(block, TransformerBlock):
                block.compile(backend="inductor")
        tokens = torch.randint(0, 100, (2, 16))
        for _ in range(3):
            model.loss(tokens, tokens).backward()
        graphs[scheme] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == {"pre_ln": 1, "lns": 2}
