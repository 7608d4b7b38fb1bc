import pytest
import torch

from lnstrain.model import Transformer, init_weights


@pytest.mark.parametrize("tied", [False, True])
def test_meta_construction_then_init_equals_direct(tiny_cfg, single, tied):
    cfg = tiny_cfg(norm_scheme="layerscale", tie_embeddings=tied, norm_type="layernorm")
    direct = Transformer(cfg, single)
    with torch.device("meta"):
        meta = Transformer(cfg, single)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    init_weights(meta, cfg)
    for (name, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_init_is_seeded(tiny_cfg, single):
    cfg = tiny_cfg()
    model = Transformer(cfg, single)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    init_weights(model, cfg, seed=7)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert "layers.0.attention.qkv_proj.weight" in changed
    init_weights(model, cfg)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_init_statistics_and_padding(tiny_cfg, single):
    cfg = tiny_cfg(hidden_size=64, ffn_hidden_size=128, init_std=0.05)
    model = Transformer(cfg, single)
    embedding = model.embedding.word_embeddings.weight
    assert embedding.shape[0] == cfg.padded_vocab_size(1) > cfg.vocab_size
    assert torch.all(embedding[cfg.vocab_size:] == 0)
    assert embedding[:cfg.vocab_size].std().item() == pytest.approx(0.05, rel=0.05)
    assert torch.all(model.output.head.weight[cfg.vocab_size:] == 0)
    assert torch.all(model.layers[0].attention_norm.weight == 1)
    assert not torch.equal(model.layers[0].attention.qkv_proj.weight, model.layers[1].attention.qkv_proj.weight)


def test_separate_qkv_has_same_weights_as_fused(tiny_cfg, single):
    fused = Transformer(tiny_cfg(fused_qkv=True), single).layers[1].attention
    separate = Transformer(tiny_cfg(fused_qkv=False), single).layers[1].attention
    torch.testing.assert_close(
        fused.qkv_proj.weight,
        torch.cat([separate.q_proj.weight, separate.k_proj.weight, separate.v_proj.weight]))
