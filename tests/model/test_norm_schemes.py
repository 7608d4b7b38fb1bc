"""Each norm scheme against its formula, on tiny blocks with hand-set norm gains."""

import math

import pytest
import torch

from lnstrain.model import NormScheme, Transformer, TransformerBlock, lns_factor
from lnstrain.model.norm_schemes import cait_layerscale_init, deepnorm_alpha, deepnorm_beta

torch.manual_seed(0)


def rms(x, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def block_with_gains(cfg, layer_number, groups):
    block = TransformerBlock(cfg, layer_number, groups)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if "norm" in name:
                param.copy_(torch.linspace(0.5, 1.5, param.numel()))
    return block


def x_in(cfg):
    return torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(1))


def pre_ln_reference(block, x, norm_scale=1.0, out_scale=1.0):
    h = x + out_scale * block.attention(rms(x) * block.attention_norm.weight * norm_scale)
    return h + out_scale * block.mlp(rms(h) * block.mlp_norm.weight * norm_scale)


def post_ln_reference(block, x, alpha=1.0):
    h = rms(alpha * x + block.attention(x)) * block.attention_norm.weight
    return rms(alpha * h + block.mlp(h)) * block.mlp_norm.weight


def test_lns_factor_values():
    assert [lns_factor(n) for n in (1, 3, 4)] == [1.0, 1 / math.sqrt(3), 0.5]
    with pytest.raises(ValueError):
        lns_factor(0)


@pytest.mark.parametrize("layer_number", [1, 3])
def test_pre_ln_and_lns(tiny_cfg, single, layer_number):
    for scheme, factor in [(NormScheme.PRE_LN, 1.0), (NormScheme.LNS, 1 / math.sqrt(layer_number))]:
        cfg = tiny_cfg(norm_scheme=scheme)
        block = block_with_gains(cfg, layer_number, single)
        x = x_in(cfg)
        torch.testing.assert_close(block(x), pre_ln_reference(block, x, norm_scale=factor))


def test_lns_mlp_input_is_pre_ln_times_inverse_sqrt_layer(tiny_cfg, single):
    lns = block_with_gains(tiny_cfg(norm_scheme="lns"), 3, single)
    pre = block_with_gains(tiny_cfg(norm_scheme="pre_ln"), 3, single)
    seen = {}
    lns.mlp.register_forward_pre_hook(lambda m, args: seen.update(mlp_input=args[0]))
    lns.mlp_norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    lns(x_in(tiny_cfg()))
    torch.testing.assert_close(seen["mlp_input"], pre.mlp_norm(seen["h"]) / math.sqrt(3))
    assert lns.lns_factor == pytest.approx(1 / math.sqrt(3)) and pre.lns_factor == 1.0


def test_lns_after_sublayer(tiny_cfg, single):
    cfg = tiny_cfg(norm_scheme="lns_after_sublayer")
    block = block_with_gains(cfg, 4, single)
    x = x_in(cfg)
    torch.testing.assert_close(block(x), pre_ln_reference(block, x, out_scale=0.5))
    assert block.attention_norm.output_scale == 1.0


def test_lns_factor_set_equals_inverse_sqrt_layer(tiny_cfg, single):
    for scheme in ("lns", "lns_after_sublayer"):
        cfg = tiny_cfg(norm_scheme=scheme, num_layers=4)
        model = Transformer(cfg, single)
        assert {(b.layer_number, b.lns_factor) for b in model.layers} == {(n, 1 / math.sqrt(n)) for n in range(1, 5)}
    lns_model = Transformer(tiny_cfg(norm_scheme="lns", num_layers=4), single)
    assert {(b.layer_number, b.attention_norm.output_scale, b.mlp_norm.output_scale) for b in lns_model.layers} == {
        (n, 1 / math.sqrt(n), 1 / math.sqrt(n)) for n in range(1, 5)}


def test_lns_gain_init_is_lns_at_step_zero(tiny_cfg, single, tokens):
    lns = Transformer(tiny_cfg(norm_scheme="lns", num_layers=4), single)
    gain_init = Transformer(tiny_cfg(norm_scheme="lns_gain_init", num_layers=4), single)
    torch.testing.assert_close(gain_init(tokens), lns(tokens), rtol=1e-6, atol=1e-6)
    for block in gain_init.layers:
        factor = 1 / math.sqrt(block.layer_number)
        assert block.lns_factor == 1.0 and block.attention_norm.output_scale == block.mlp_norm.output_scale == 1.0
        for norm in (block.attention_norm, block.mlp_norm):
            assert torch.equal(norm.weight, torch.full_like(norm.weight, factor))
            norm.weight.data.zero_()
            norm.reset_parameters()  # init_weights' path (meta construction) gives the same start
            assert torch.equal(norm.weight, torch.full_like(norm.weight, factor))
    assert torch.equal(gain_init.output.final_norm.weight, torch.ones_like(gain_init.output.final_norm.weight))
    others = {k: v for k, v in gain_init.state_dict().items() if "_norm" not in k or "final" in k}
    assert all(torch.equal(v, lns.state_dict()[k]) for k, v in others.items())


def test_lns_gain_init_moves_the_effective_gain_at_full_speed(tiny_cfg, single, tokens):
    """The optimizer hypothesis in one Adam step: LNS's effective gain w/sqrt(l) moves by lr/sqrt(l)
    (Adam's first step moves each weight by lr), lns_gain_init's gain by lr."""
    lr, layer = 1e-2, 4
    moved = {}
    for scheme in ("lns", "lns_gain_init"):
        model = Transformer(tiny_cfg(norm_scheme=scheme, num_layers=layer), single)
        norm = model.layers[layer - 1].mlp_norm
        before = norm.weight.detach() * norm.output_scale
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-30)
        model.loss(tokens, tokens.roll(-1, dims=1), torch.ones_like(tokens, dtype=torch.float)).backward()
        optimizer.step()
        moved[scheme] = (norm.weight.detach() * norm.output_scale - before).abs()
    torch.testing.assert_close(moved["lns"], torch.full_like(moved["lns"], lr / math.sqrt(layer)), rtol=1e-4, atol=0)
    torch.testing.assert_close(moved["lns_gain_init"], torch.full_like(moved["lns"], lr), rtol=1e-4, atol=0)


def test_lns_factor_is_plain_float_not_state(tiny_cfg, single):
    lns = Transformer(tiny_cfg(norm_scheme="lns"), single)
    pre = Transformer(tiny_cfg(norm_scheme="pre_ln"), single)
    assert lns.state_dict().keys() == pre.state_dict().keys()
    assert type(lns.layers[2].attention_norm.output_scale) is float
    for name, value in lns.state_dict().items():
        torch.testing.assert_close(value, pre.state_dict()[name])  # same seeded init, factor not stored


def test_final_norm_not_scaled(tiny_cfg, single, tokens):
    model = Transformer(tiny_cfg(norm_scheme="lns"), single)
    assert model.output.final_norm.output_scale == 1.0
    seen = {}
    model.output.final_norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    logits = model(tokens)
    expected = (rms(seen["h"]) * model.output.final_norm.weight) @ model.output.head.weight.T
    torch.testing.assert_close(logits, expected)


def test_post_ln_normalises_after_residual_add(tiny_cfg, single):
    cfg = tiny_cfg(norm_scheme="post_ln")
    block = block_with_gains(cfg, 2, single)
    x = x_in(cfg)
    torch.testing.assert_close(block(x), post_ln_reference(block, x))
    assert isinstance(Transformer(cfg, single).output.final_norm, torch.nn.Identity)


def test_deepnorm_alpha_beta(tiny_cfg, single):
    cfg = tiny_cfg(norm_scheme="deepnorm", num_layers=3)
    assert deepnorm_alpha(3) == pytest.approx(6 ** 0.25) and deepnorm_beta(3) == pytest.approx(24 ** -0.25)
    block = block_with_gains(cfg, 2, single)
    x = x_in(cfg)
    torch.testing.assert_close(block(x), post_ln_reference(block, x, alpha=6 ** 0.25))
    # beta scales v, o and the FFN weights, not q and k (same seeded draws as Pre-LN)
    plain = TransformerBlock(tiny_cfg(norm_scheme="pre_ln", num_layers=3), 2, single)
    q_size = cfg.num_heads * cfg.head_dim
    kv_size = cfg.kv_heads * cfg.head_dim
    deep_qkv, plain_qkv = block.attention.qkv_proj.weight, plain.attention.qkv_proj.weight
    torch.testing.assert_close(deep_qkv[:q_size + kv_size], plain_qkv[:q_size + kv_size])
    torch.testing.assert_close(deep_qkv[q_size + kv_size:], plain_qkv[q_size + kv_size:] * 24 ** -0.25)
    for name in ("attention.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"):
        torch.testing.assert_close(block.get_parameter(name), plain.get_parameter(name) * 24 ** -0.25)


@pytest.mark.parametrize("alpha,num_post", [(0.25, 1), (0.5, 2), (0.0, 0)])
def test_mix_ln_first_layers_post_ln(tiny_cfg, single, alpha, num_post):
    cfg = tiny_cfg(norm_scheme="mix_ln", mix_ln_alpha=alpha, num_layers=4)
    x = x_in(cfg)
    for layer_number in range(1, 5):
        block = block_with_gains(cfg, layer_number, single)
        expected = post_ln_reference(block, x) if layer_number <= num_post else pre_ln_reference(block, x)
        torch.testing.assert_close(block(x), expected)


def test_sandwich_ln(tiny_cfg, single):
    cfg = tiny_cfg(norm_scheme="sandwich_ln")
    block = block_with_gains(cfg, 2, single)
    x = x_in(cfg)
    h = x + rms(block.attention(rms(x) * block.attention_norm.weight)) * block.attention_output_norm.weight
    out = h + rms(block.mlp(rms(h) * block.mlp_norm.weight)) * block.mlp_output_norm.weight
    torch.testing.assert_close(block(x), out)


def test_layerscale_formula_and_init(tiny_cfg, single):
    assert [cait_layerscale_init(d) for d in (12, 18, 20, 24, 36)] == [0.1, 0.1, 1e-5, 1e-5, 1e-6]
    cfg = tiny_cfg(norm_scheme="layerscale")
    block = block_with_gains(cfg, 2, single)
    assert torch.all(block.attention_layerscale.gain == 0.1)
    assert torch.all(TransformerBlock(tiny_cfg(norm_scheme="layerscale", num_layers=30), 1, single).mlp_layerscale.gain == 1e-6)
    assert torch.all(TransformerBlock(tiny_cfg(norm_scheme="layerscale", layerscale_init=0.3), 1, single).mlp_layerscale.gain == 0.3)
    with torch.no_grad():
        block.attention_layerscale.gain.copy_(torch.linspace(0.1, 2, cfg.hidden_size))
    x = x_in(cfg)
    h = x + block.attention_layerscale.gain * block.attention(rms(x) * block.attention_norm.weight)
    out = h + block.mlp_layerscale.gain * block.mlp(rms(h) * block.mlp_norm.weight)
    torch.testing.assert_close(block(x), out)


def test_scaled_init_divides_output_projections(tiny_cfg, single):
    scaled = TransformerBlock(tiny_cfg(scaled_init=True), 2, single)
    plain = TransformerBlock(tiny_cfg(), 2, single)
    factor = 1 / math.sqrt(2 * 3)
    torch.testing.assert_close(scaled.attention.o_proj.weight, plain.attention.o_proj.weight * factor)
    torch.testing.assert_close(scaled.mlp.down_proj.weight, plain.mlp.down_proj.weight * factor)
    torch.testing.assert_close(scaled.attention.qkv_proj.weight, plain.attention.qkv_proj.weight)


def test_layernorm_option_folds_scale_into_gain_and_bias(tiny_cfg, single):
    block = TransformerBlock(tiny_cfg(norm_scheme="lns", norm_type="layernorm"), 4, single)
    with torch.no_grad():
        block.attention_norm.bias.fill_(0.3)
    x = x_in(tiny_cfg())
    reference = torch.nn.functional.layer_norm(x, (x.shape[-1],), block.attention_norm.weight,
                                               block.attention_norm.bias, 1e-5) * 0.5
    torch.testing.assert_close(block.attention_norm(x), reference)
