import dataclasses

import pytest
import torch

from lnstrain.model import MODEL_PRESETS, ModelConfig, NormScheme, Transformer, model_preset


def test_defaults_are_valid():
    assert ModelConfig().validate() == []


def test_validate_reports_every_problem_by_key():
    cfg = ModelConfig(hidden_size=4000, num_heads=48, num_kv_heads=5, norm_eps=0.0, mix_ln_alpha=2.0)
    problems = cfg.validate()
    assert "model.hidden_size (4000) must be divisible by model.num_heads (48)" in problems
    assert any(p.startswith("model.num_kv_heads (5)") for p in problems)
    assert any(p.startswith("model.norm_eps") for p in problems)
    assert any(p.startswith("model.mix_ln_alpha") for p in problems)


def test_validate_checks_tensor_parallel_divisibility():
    cfg = ModelConfig(num_heads=32, num_kv_heads=8, ffn_hidden_size=5461)
    problems = cfg.validate(tensor_parallel=3)
    assert any(p.startswith("model.num_heads (32)") for p in problems)
    assert any(p.startswith("model.num_kv_heads (8)") for p in problems)
    assert any(p.startswith("model.ffn_hidden_size (5461)") for p in problems)
    assert ModelConfig(num_kv_heads=2).validate(tensor_parallel=8) == []  # KV heads replicated
    assert any(p.startswith("model.hidden_dropout") for p in ModelConfig(hidden_dropout=0.1).validate(2))


def test_norm_scheme_from_string_and_unknown_reported():
    assert ModelConfig(norm_scheme="lns").norm_scheme is NormScheme.LNS
    assert any("model.norm_scheme" in p for p in ModelConfig(norm_scheme="lsn").validate())


def test_padded_vocab_size():
    cfg = ModelConfig(vocab_size=32000, make_vocab_size_divisible_by=128)
    assert cfg.padded_vocab_size(1) == 32000
    assert cfg.padded_vocab_size(3) == 32256
    assert ModelConfig(vocab_size=100, make_vocab_size_divisible_by=8).padded_vocab_size(2) == 112


@pytest.mark.parametrize("scheme", list(NormScheme))
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_formula_matches_model(scheme, tied, tiny_cfg, single):
    cfg = tiny_cfg(norm_scheme=scheme, tie_embeddings=tied, norm_type="layernorm" if tied else "rmsnorm")
    with torch.device("meta"):
        model = Transformer(cfg, single)
    assert cfg.num_parameters(tensor_parallel=1) == sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for n, p in model.named_parameters() if "word_embeddings" in n or "head" in n)
    assert cfg.num_non_embedding_parameters == sum(p.numel() for p in model.parameters()) - embedding


def test_presets_build_valid_configs():
    for name in MODEL_PRESETS:
        assert model_preset(name).validate() == [], name
    assert model_preset("7b").num_parameters() == 6_738_415_616  # LLaMA-7B
    assert model_preset("60m", norm_scheme=NormScheme.LNS).norm_scheme is NormScheme.LNS
    assert model_preset("tiny") is not model_preset("tiny")


def test_fields_are_plain_types():
    for field in dataclasses.fields(ModelConfig):
        assert field.type.split("[")[0].split(" |")[0] in {"int", "float", "bool", "str", "NormScheme", "Literal"}, field


def test_ffn_multiple_of_rounds_the_width_up_as_llama_does(tmp_path):
    paper, fast = model_preset("1b"), model_preset("1b_fast")
    assert paper.ffn_hidden_size == 5461 and fast.ffn_hidden_size == 5632  # 22 × 256
    assert fast.ffn_hidden_size % 256 == 0 and fast.validate(tensor_parallel=8) == []
    assert any("ffn_multiple_of" in problem for problem in paper.validate(tensor_parallel=2))
    assert dataclasses.replace(fast).ffn_hidden_size == 5632  # idempotent: a resolved config reloads unchanged
    assert ModelConfig(ffn_hidden_size=64, ffn_multiple_of=64).ffn_hidden_size == 64
    assert any("ffn_multiple_of" in problem for problem in ModelConfig(ffn_multiple_of=0).validate())
    from lnstrain.config.run_config import config_from_dict

    config = config_from_dict({"model": {"preset": "1b", "ffn_multiple_of": 128},
                               "data": {"sources": [{"prefix": "x"}]}, "train": {"steps": 1}})
    assert config.model.ffn_hidden_size == 5504  # 43 × 128
