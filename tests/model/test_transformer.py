import pytest
import torch
import torch.nn.functional as F

from lnstrain.model import EmbeddingStage, OutputStage, Transformer, TransformerBlock, init_weights
from lnstrain.parallel.cross_entropy import vocab_parallel_cross_entropy


def test_stages_compose_to_the_model(tiny_cfg, single, tokens):
    cfg = tiny_cfg(tie_embeddings=True, norm_scheme="lns")
    model = Transformer(cfg, single)
    embedding, output = EmbeddingStage(cfg, single), OutputStage(cfg, single)
    blocks = [TransformerBlock(cfg, n, single) for n in range(1, cfg.num_layers + 1)]
    hidden = embedding(tokens)
    assert hidden.shape == (2, 16, cfg.hidden_size)
    for block in blocks:
        hidden = block(hidden)
    logits = output(hidden, embedding.word_embeddings.weight)
    assert logits.shape == (2, 16, cfg.padded_vocab_size(1))
    torch.testing.assert_close(logits, model(tokens))  # pieces built alone get the same weights
    assert output.head is None


def test_causal(tiny_cfg, single, tokens):
    model = Transformer(tiny_cfg(), single)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 100
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])


def test_gqa_equals_multi_head_with_repeated_kv(tiny_cfg, single):
    from lnstrain.model.attention import Attention
    cfg = tiny_cfg(num_heads=4, num_kv_heads=2, fused_qkv=False)
    gqa = Attention(cfg, single)
    init_weights(gqa, cfg)
    mha = Attention(tiny_cfg(num_heads=4, num_kv_heads=4, fused_qkv=False), single)
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            heads = getattr(gqa, name).weight.view(2, cfg.head_dim, -1)
            getattr(mha, name).weight.copy_(heads.repeat_interleave(2, dim=0).reshape(-1, cfg.hidden_size))
    x = torch.randn(2, 16, cfg.hidden_size)
    torch.testing.assert_close(gqa(x), mha(x))


def test_loss_excludes_padded_vocab_and_honours_mask(tiny_cfg, single, tokens):
    cfg = tiny_cfg()
    model = Transformer(cfg, single)
    labels = tokens.roll(-1, dims=1)
    mask = torch.ones_like(tokens)
    mask[:, -4:] = 0
    logits = model(tokens)
    with torch.no_grad():
        logits[..., cfg.vocab_size:] = 50.0  # padded entries must not matter
    per_token = F.cross_entropy(logits[..., :cfg.vocab_size].reshape(-1, cfg.vocab_size), labels.reshape(-1),
                                reduction="none").view_as(labels)
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, labels, single, cfg.vocab_size), per_token)
    expected = (per_token * mask).sum() / mask.sum()
    torch.testing.assert_close(model.loss(tokens, labels, mask), expected)


def test_cross_entropy_gradient_matches_autograd(single):
    logits = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 12, (2, 5))
    ours = vocab_parallel_cross_entropy(logits, labels, single, vocab_size=12)
    weights = torch.rand(2, 5, dtype=torch.float64)
    (ours * weights).sum().backward()
    reference_logits = logits.detach()[..., :12].clone().requires_grad_()
    (F.cross_entropy(reference_logits.reshape(-1, 12), labels.reshape(-1), reduction="none") * weights.reshape(-1)).sum().backward()
    torch.testing.assert_close(logits.grad[..., :12], reference_logits.grad)
    assert torch.all(logits.grad[..., 12:] == 0)


def _gradients_and_core_calls(cfg, single, tokens, mode):
    """Gradients, and how often the layers' attention cores were entered in forward and in backward."""
    model = Transformer(cfg, single)
    model.set_activation_checkpointing(mode)
    calls = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def counting(core):
        def counted(*args):
            calls[phase[0]] += 1  # on entry: recomputation may stop early, once it has what backward needs
            return core(*args)
        return counted
    for layer in model.layers:
        layer.attention.core = counting(layer.attention.core)
    loss = model.loss(tokens, tokens.roll(-1, 1))
    phase[0] = "backward"
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("mode, core_calls_in_backward", [("full", 3), ("selective", 3), (True, 3)])
def test_activation_checkpointing_gives_same_gradients(tiny_cfg, single, tokens, mode, core_calls_in_backward):
    cfg = tiny_cfg(norm_scheme="lns", attention_dropout=0.1)  # recomputation must replay the dropout mask
    torch.manual_seed(0)
    reference, calls = _gradients_and_core_calls(cfg, single, tokens, "none")
    assert calls == {"forward": cfg.num_layers, "backward": 0}
    torch.manual_seed(0)
    grads, calls = _gradients_and_core_calls(cfg, single, tokens, mode)
    assert calls == {"forward": cfg.num_layers, "backward": core_calls_in_backward}
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_selective_checkpointing_recomputes_only_the_attention_core(tiny_cfg, single, tokens):
    model = Transformer(tiny_cfg(), single)
    model.set_activation_checkpointing("selective")
    layer = model.layers[0]
    assert layer.attention.checkpoint_core and not layer.checkpoint_activations
    ran_in_backward = []
    for name in ("attention_norm", "mlp"):
        getattr(layer, name).register_forward_hook(lambda *args, _name=name: ran_in_backward.append(_name))
    loss = model.loss(tokens, tokens.roll(-1, 1))
    ran_in_backward.clear()
    loss.backward()
    assert ran_in_backward == []  # only the core re-runs (counted above); norms and MLP do not
    with pytest.raises(ValueError, match="'none', 'full' or 'selective'"):
        layer.set_activation_checkpointing("attention")


def test_invalid_config_is_refused(tiny_cfg, single):
    import pytest
    with pytest.raises(ValueError, match="model.hidden_size"):
        Transformer(tiny_cfg(hidden_size=30), single)
