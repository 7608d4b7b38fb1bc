"""Hugging Face LLaMA export and import: logits against lnstrain's forward, refusals, round trip, mismatches.

Every export is checked twice: with ``transformers.LlamaForCausalLM`` (when installed) and with an
independent LLaMA forward written here from the formulas (rotary pairs (i, i + d/2), RMSNorm, GQA by
repeating KV heads), both against lnstrain's own single-process forward, fp32, within 1e-4.
"""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from lnstrain.checkpoint.consolidated_file import load_init_state_dict, save_consolidated
from lnstrain.checkpoint.hf_io import load_hf_llama_state_dict, read_hf_tensors, save_hf_checkpoint
from lnstrain.checkpoint.hf_exportable import export_problems
from lnstrain.checkpoint.hf_llama import to_hf_state_dict
from lnstrain.checkpoint.lns_fold import UNFOLDED_WEIGHTS_FILE
from lnstrain.checkpoint.sharding import StateDictMismatchError, apply_full_state_dict
from lnstrain.model import ModelConfig, Transformer
from lnstrain.parallel.groups import ParallelGroups
from tests.tool_scripts import load_tool

LOGIT_TOLERANCE = 1e-4
def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(vocab_size=100, hidden_size=32, num_layers=3, num_heads=4, ffn_hidden_size=64, max_seq_len=32,
                make_vocab_size_divisible_by=64, norm_scheme="lns", rope_theta=500.0, norm_eps=1e-5)
    return ModelConfig(**{**base, **overrides})


def perturbed_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A single-process model whose every weight (norm gains included) is random, padding rows zero,
    so that a wrong fold, split or permutation shows in the logits."""
    model = Transformer(cfg, ParallelGroups.single_process()).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.08 * noise)
            if "word_embeddings" in name or "head" in name:
                param[cfg.vocab_size:] = 0.0
    return model


def tokens(cfg: ModelConfig, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))


def _rotate_pairs_of_halves(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE written from the formula: pair (i, i + d/2) rotated by position * theta^(-2i/d)."""
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * frequencies[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def reference_llama_logits(hf: dict[str, torch.Tensor], config: dict, ids: torch.Tensor) -> torch.Tensor:
    """LLaMA's forward from Hugging Face tensors and config.json alone (no lnstrain, no transformers)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    head_dim = config["hidden_size"] // heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    x = hf["model.embed_tokens.weight"][ids]
    batch, seq, _ = x.shape
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, hf[p + "input_layernorm.weight"])
        q = (h @ hf[p + "self_attn.q_proj.weight"].T).view(batch, seq, heads, head_dim).transpose(1, 2)
        k = (h @ hf[p + "self_attn.k_proj.weight"].T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        v = (h @ hf[p + "self_attn.v_proj.weight"].T).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        q, k = _rotate_pairs_of_halves(q, theta), _rotate_pairs_of_halves(k, theta)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        attention = torch.softmax(q @ k.transpose(-1, -2) / head_dim ** 0.5 + mask, dim=-1) @ v
        x = x + attention.transpose(1, 2).reshape(batch, seq, -1) @ hf[p + "self_attn.o_proj.weight"].T
        h = rms(x, hf[p + "post_attention_layernorm.weight"])
        mlp = F.silu(h @ hf[p + "mlp.gate_proj.weight"].T) * (h @ hf[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ hf[p + "mlp.down_proj.weight"].T
    head = hf["lm_head.weight"] if "lm_head.weight" in hf else hf["model.embed_tokens.weight"]
    return rms(x, hf["model.norm.weight"]) @ head.T


def export_and_compare(cfg: ModelConfig, directory) -> None:
    model = perturbed_model(cfg)
    ids = tokens(cfg)
    with torch.no_grad():
        ours = model(ids)[..., :cfg.vocab_size]
    save_hf_checkpoint(model.state_dict(), cfg, directory, dtype="fp32", shard_size="20KB")
    config = json.loads((directory / "config.json").read_text())
    hf = read_hf_tensors(directory)
    assert hf["model.embed_tokens.weight"].shape[0] == cfg.vocab_size == config["vocab_size"]
    with torch.no_grad():
        reference = reference_llama_logits(hf, config, ids)
    assert (reference - ours).abs().max() <= LOGIT_TOLERANCE
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf_model(ids).logits
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max() <= LOGIT_TOLERANCE, (theirs - ours).abs().max()


@pytest.mark.parametrize("case", [
    dict(norm_scheme="pre_ln"),
    dict(norm_scheme="pre_ln", scaled_init=True, tie_embeddings=True),
    dict(norm_scheme="lns"),
    dict(norm_scheme="lns", tie_embeddings=True, num_kv_heads=2),
    dict(norm_scheme="lns", num_kv_heads=1, fused_qkv=False),
    dict(norm_scheme="lns_after_sublayer"),
    dict(norm_scheme="lns_after_sublayer", tie_embeddings=True, num_kv_heads=2),
    dict(norm_scheme="lns_gain_init", tie_embeddings=True, num_kv_heads=2),
    dict(norm_scheme="mix_ln"),  # floor(0.25 * 3) = 0 Post-LN layers: every block is Pre-LN
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_export_reproduces_lnstrain_logits(case, tmp_path):
    export_and_compare(tiny_cfg(**case), tmp_path / "hf")


def test_export_writes_index_config_and_tokenizer(tmp_path, tiny_corpus):
    cfg = tiny_cfg(vocab_size=tiny_corpus.vocab_size)
    save_hf_checkpoint(perturbed_model(cfg).state_dict(), cfg, tmp_path, dtype="bf16", shard_size="20KB",
                       tokenizer_path=str(tiny_corpus.tokenizer))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["lnstrain"]["norm_scheme"] == "lns"
    assert config["num_key_value_heads"] == cfg.kv_heads and config["max_position_embeddings"] == cfg.max_seq_len
    assert read_hf_tensors(tmp_path)["model.norm.weight"].dtype == torch.bfloat16
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "LlamaTokenizer"
    assert (tmp_path / "tokenizer.model").read_bytes() == tiny_corpus.tokenizer.read_bytes()
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tiny_corpus.tokenizer))
    assert (config["bos_token_id"], config["eos_token_id"]) == (sp.bos_id(), sp.eos_id())


@pytest.mark.parametrize("scheme, reason", [
    ("post_ln", "Post-LN normalises after the residual add"),
    ("deepnorm", "DeepNorm is Post-LN"),
    ("mix_ln", "Mix-LN's first layers are Post-LN"),
    ("sandwich_ln", "Sandwich-LN normalises each sublayer's output"),
    ("layerscale", "LayerScale multiplies each sublayer's output by a learned per-channel gain"),
])
def test_export_refuses_schemes_llama_cannot_compute(scheme, reason):
    cfg = tiny_cfg(norm_scheme=scheme, num_layers=8)  # Mix-LN: layers 1-2 Post-LN
    [problem] = export_problems(cfg)
    assert problem.startswith(f"model.norm_scheme={scheme} cannot be exported as a Hugging Face LLaMA: {reason}")
    with pytest.raises(ValueError, match=f"model.norm_scheme={scheme} cannot be exported"):
        to_hf_state_dict(perturbed_model(cfg).state_dict(), cfg)


def test_export_refuses_layernorm():
    cfg = tiny_cfg(norm_type="layernorm", norm_scheme="pre_ln")
    assert export_problems(cfg) == ["model.norm_type=layernorm cannot be exported: LLaMA uses RMSNorm "
                                    "(no mean subtraction, no bias)"]


@pytest.mark.parametrize("scheme", ["pre_ln", "lns", "lns_after_sublayer", "lns_gain_init"])
def test_import_round_trip_restores_the_state_dict(scheme, tmp_path, caplog):
    """The export's config.json record makes the import unfold by itself; lns gets its gains back bit for bit."""
    cfg = tiny_cfg(norm_scheme=scheme, num_kv_heads=2)
    original = perturbed_model(cfg).state_dict()
    save_hf_checkpoint(original, cfg, tmp_path, dtype="fp32")
    with caplog.at_level(logging.INFO):
        imported = load_hf_llama_state_dict(tmp_path, cfg)
    assert sorted(imported) == sorted(original)
    for name, tensor in original.items():
        if scheme == "lns_after_sublayer":  # o_proj/down_proj: x * (1/sqrt l) / (1/sqrt l) may differ in the last bit
            torch.testing.assert_close(imported[name], tensor, rtol=1e-6, atol=0, msg=name)
        else:
            assert torch.equal(imported[name], tensor), name
    if scheme in ("lns", "lns_after_sublayer"):
        assert "config.json records that lnstrain folded" in caplog.text and "weights unfolded" in caplog.text
    else:  # nothing folded: pre_ln, and lns_gain_init, whose 1/sqrt(l) lives in the gains themselves
        assert f"nothing folded, nothing to unfold into norm_scheme={scheme}" in caplog.text
    model = Transformer(cfg, ParallelGroups.single_process())
    apply_full_state_dict(model, imported)
    ids = tokens(cfg)
    with torch.no_grad():
        expected = perturbed_model(cfg)(ids)
        assert (model(ids) - expected).abs().max() <= 1e-5


def test_lns_and_lns_gain_init_export_the_same_llama_at_initialisation():
    """Same function at step 0: LNS folds 1/sqrt(l) into the gains, lns_gain_init starts its gains there."""
    lns, gain_init = (tiny_cfg(norm_scheme=scheme, num_layers=4) for scheme in ("lns", "lns_gain_init"))
    exported = [to_hf_state_dict(Transformer(cfg, ParallelGroups.single_process()).state_dict(), cfg)
                for cfg in (lns, gain_init)]
    assert exported[0].keys() == exported[1].keys()
    for name, tensor in exported[0].items():
        assert torch.equal(tensor, exported[1][name]), name
    assert torch.equal(exported[1]["model.layers.3.input_layernorm.weight"],
                       torch.full_like(exported[1]["model.layers.3.input_layernorm.weight"], 0.5))


def test_unfold_without_exact_gains_computes_the_same_function(tmp_path):
    """Without the side file of gains as trained (or with one a fine-tune made stale) the gains are divided
    back: some differ from the originals in the last bit, but LNS multiplies them back to the exported ones."""
    cfg = tiny_cfg(norm_scheme="lns", num_layers=6)
    original = perturbed_model(cfg).state_dict()
    save_hf_checkpoint(original, cfg, tmp_path, dtype="fp32")
    (tmp_path / UNFOLDED_WEIGHTS_FILE).unlink()
    imported = load_hf_llama_state_dict(tmp_path, cfg)
    exported = read_hf_tensors(tmp_path)
    differing = 0
    for index in range(cfg.num_layers):
        gain = imported[f"layers.{index}.attention_norm.weight"]
        factor = 1 / (index + 1) ** 0.5
        assert torch.equal(gain * factor, exported[f"model.layers.{index}.input_layernorm.weight"])
        differing += int((gain != original[f"layers.{index}.attention_norm.weight"]).sum())
    assert differing > 0  # the reason for the side file: division alone does not give every gain back
    model = Transformer(cfg, ParallelGroups.single_process())
    apply_full_state_dict(model, imported)
    ids = tokens(cfg)
    with torch.no_grad():
        assert torch.equal(model(ids), perturbed_model(cfg)(ids))


def test_export_records_the_fold_and_the_switch_overrides_it(tmp_path, caplog):
    cfg = tiny_cfg(norm_scheme="lns")
    original = perturbed_model(cfg).state_dict()
    save_hf_checkpoint(original, cfg, tmp_path, dtype="fp32")
    record = json.loads((tmp_path / "config.json").read_text())["lnstrain"]
    assert record["norm_scheme"] == "lns"
    assert record["lns_folded_into"] == ["input_layernorm", "post_attention_layernorm"]
    assert record["layer_factors"] == [1.0, 1 / 2 ** 0.5, 1 / 3 ** 0.5]
    with caplog.at_level(logging.INFO):
        as_they_are = load_hf_llama_state_dict(tmp_path, cfg, unfold_lns=False)
    assert "not unfolding the LNS factors, as asked (weights loaded as they are)" in caplog.text
    folded = read_hf_tensors(tmp_path)["model.layers.2.input_layernorm.weight"]
    assert torch.equal(as_they_are["layers.2.attention_norm.weight"], folded)
    pre_ln = load_hf_llama_state_dict(tmp_path, tiny_cfg(norm_scheme="pre_ln"))  # same function, nothing to unfold
    assert torch.equal(pre_ln["layers.2.attention_norm.weight"], folded)


def test_import_into_lns_without_unfolding_warns(tmp_path, caplog):
    plain = tiny_cfg(norm_scheme="pre_ln")
    save_hf_checkpoint(perturbed_model(plain).state_dict(), plain, tmp_path, dtype="fp32")
    with caplog.at_level(logging.WARNING):
        state = load_hf_llama_state_dict(tmp_path, tiny_cfg(norm_scheme="lns"))
    assert "computes a different function" in caplog.text
    assert torch.equal(state["layers.2.attention_norm.weight"], perturbed_model(plain).state_dict()["layers.2.attention_norm.weight"])


def test_import_lists_config_differences(tmp_path):
    cfg = tiny_cfg(norm_scheme="pre_ln")
    save_hf_checkpoint(perturbed_model(cfg).state_dict(), cfg, tmp_path, dtype="fp32")
    with pytest.raises(ValueError) as error:
        load_hf_llama_state_dict(tmp_path, tiny_cfg(norm_scheme="pre_ln", ffn_hidden_size=96, num_layers=4))
    message = str(error.value)
    assert "config.json intermediate_size=64 but model.ffn_hidden_size=96" in message
    assert "config.json num_hidden_layers=3 but model.num_layers=4" in message


def test_wrong_shapes_give_a_readable_mismatch_list(tmp_path):
    cfg = tiny_cfg(norm_scheme="pre_ln")
    state = perturbed_model(cfg).state_dict()
    state["layers.1.mlp.down_proj.weight"] = torch.zeros(32, 96)
    del state["layers.2.mlp_norm.weight"]
    state["layers.3.mlp_norm.weight"] = torch.ones(32)
    path = save_consolidated(tmp_path / "wrong.safetensors", state)
    with pytest.raises(StateDictMismatchError) as error:
        load_init_state_dict(path, cfg)
    message = str(error.value)
    assert message.startswith(f"{path} does not fit the model of this config (hidden_size=32, num_layers=3")
    assert "  wrong shape (1):\n    layers.1.mlp.down_proj.weight: file [32, 96], model [32, 64]" in message
    assert "  missing from the file (1):\n    layers.2.mlp_norm.weight" in message
    assert "  in the file but not in the model (1):\n    layers.3.mlp_norm.weight" in message
    assert error.value.missing == ["layers.2.mlp_norm.weight"]


def test_init_from_accepts_consolidated_pt_and_hf(tmp_path):
    cfg = tiny_cfg(norm_scheme="pre_ln")
    state = perturbed_model(cfg).state_dict()
    save_consolidated(tmp_path / "w.safetensors", state)
    torch.save(state, tmp_path / "w.pt")
    save_hf_checkpoint(state, cfg, tmp_path / "hf", dtype="fp32")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    for source in ("w.safetensors", "w.pt", "hf"):
        loaded = load_init_state_dict(tmp_path / source, cfg)
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), source
    with pytest.raises(StateDictMismatchError, match="in the file but not in the model"):
        load_init_state_dict(tmp_path / "x.safetensors", cfg)


def test_convert_from_hf_tool_writes_an_init_file(tmp_path, capsys):
    from lnstrain.checkpoint.consolidated_file import load_consolidated
    from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG

    cfg = tiny_cfg(norm_scheme="lns", vocab_size=256, num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=64,
                   rope_theta=10000.0)
    original = perturbed_model(cfg).state_dict()
    save_hf_checkpoint(original, cfg, tmp_path / "hf", dtype="fp32")
    tool = load_tool("convert_from_hf")
    output = tmp_path / "init.safetensors"
    args = ["--hf", str(tmp_path / "hf"), "--config", str(TINY_RUN_CONFIG), "--output", str(output)]
    assert tool.main(args) == 0  # unfolds: config.json records the fold
    config, state = load_consolidated(output)
    assert config.model.norm_scheme.value == "lns"
    for name, tensor in original.items():
        assert torch.equal(state[name], tensor), name
    assert tool.main(args + ["--no-unfold-lns"]) == 0
    folded = load_consolidated(output)[1]["layers.1.mlp_norm.weight"]
    assert torch.equal(folded, original["layers.1.mlp_norm.weight"] * (1 / 2 ** 0.5))
    assert tool.main(args + ["--set", "model.ffn_hidden_size=96"]) == 2
    assert "config.json intermediate_size=64 but model.ffn_hidden_size=96" in capsys.readouterr().err


def test_exported_and_consolidated_files_follow_the_umask(tmp_path):
    cfg = tiny_cfg(norm_scheme="lns")
    state = perturbed_model(cfg).state_dict()
    previous = os.umask(0o027)
    try:
        save_hf_checkpoint(state, cfg, tmp_path / "hf", dtype="fp32", shard_size="20KB")
        save_consolidated(tmp_path / "w.safetensors", state)
    finally:
        os.umask(previous)
    files = [tmp_path / "w.safetensors", *(tmp_path / "hf").iterdir()]
    assert any(f.name == UNFOLDED_WEIGHTS_FILE for f in files) and len(files) > 4
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {f.name: oct(0o640) for f in files}
