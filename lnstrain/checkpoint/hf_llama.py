"""The single-process state dict <-> a Hugging Face ``LlamaForCausalLM`` checkpoint.

Exact correspondences (checked against ``transformers`` by tests/checkpoint/test_hf_export.py):
  * fused QKV rows are [q heads | k heads | v heads] -> ``q_proj``, ``k_proj``, ``v_proj``; the fused
    SwiGLU input rows are [gate | up] -> ``gate_proj``, ``up_proj``; ``down_proj`` and ``o_proj`` as is.
  * rotary embeddings: ours rotate halves (``rotate_half``, cos/sin tables repeated over both halves)
    exactly like Hugging Face LLaMA, so q/k rows need no permutation (Meta's original interleaved
    checkpoints are the ones that need it).
  * RMSNorm: both compute x * rsqrt(mean(x²) + eps) in fp32, times the gain.
  * per-layer factors come from the model's own ``block_layout`` (``lns_fold``). A factor on the
    pre-sublayer norms' output (LayerNorm Scaling, ``lns``: norm(x) * gain * (1/√ℓ)) is folded into
    both norm gains, ``input_layernorm`` and ``post_attention_layernorm``; a factor on the sublayer's
    output (``lns_after_sublayer``) into its last linear map, ``o_proj`` and ``down_proj``.
    config.json records the fold; ``lns_fold`` unfolds it on import. The final norm is never scaled.
    ``lns_gain_init`` applies no factor (1/√ℓ is only its gains' initial value): exported as is, like Pre-LN.
  * the padded vocabulary rows are dropped; ``vocab_size`` is the tokenizer's.
A model whose layout LLaMA's block cannot compute is refused (``hf_exportable.export_problems``), as
is a state dict with tensors the export would leave behind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.checkpoint.hf_exportable import export_problems
from lnstrain.checkpoint.lns_fold import RECORD_KEY, fold_record, layer_factors, unfold
from lnstrain.checkpoint.param_names import fit_rows

logger = logging.getLogger(__name__)

def _split_sizes(cfg: ModelConfig) -> list[int]:
    return [cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face LLaMA names and tensors from lnstrain's single-process state dict (fp32)."""
    problems = export_problems(cfg)
    if problems:
        raise ValueError("\n".join(problems))
    exported: set[str] = set()

    def take(name: str) -> torch.Tensor:
        exported.add(name)
        return state[name]

    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")[:cfg.vocab_size],
           "model.norm.weight": take("output.final_norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("output.head.weight")[:cfg.vocab_size]
    for index in range(cfg.num_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        norm_factor, output_factor = layer_factors(cfg, index + 1)
        if cfg.fused_qkv:
            q, k, v = take(ours + "attention.qkv_proj.weight").split(_split_sizes(cfg))
        else:
            q, k, v = (take(ours + f"attention.{p}_proj.weight") for p in "qkv")
        gate, up = take(ours + "mlp.gate_up_proj.weight").chunk(2)
        out.update({
            theirs + "input_layernorm.weight": take(ours + "attention_norm.weight") * norm_factor,
            theirs + "post_attention_layernorm.weight": take(ours + "mlp_norm.weight") * norm_factor,
            theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": take(ours + "attention.o_proj.weight") * output_factor,
            theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": take(ours + "mlp.down_proj.weight") * output_factor,
        })
    left_behind = sorted(set(state) - exported)
    if left_behind:
        raise ValueError(f"the state dict holds {len(left_behind)} tensor(s) a Hugging Face LLaMA has no place "
                         f"for (e.g. {', '.join(left_behind[:3])}): not a model of this config "
                         f"(model.norm_scheme={NormScheme(cfg.norm_scheme).value})")
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig,
                       factors: list[tuple[float, float]] | None = None,
                       as_trained: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """lnstrain's single-process state dict from Hugging Face LLaMA tensors.

    ``factors``: per layer, the (norm gain, o_proj/down_proj) factors an LNS export folded in, to
    divide out (``lns_fold.unfold_factors`` decides); None loads the weights as they are.
    ``as_trained``: an export's side file of unfolded gains (``lns_fold``), which makes unfolding exact.
    """
    problems = export_problems(cfg)
    if problems:
        raise ValueError(f"cannot import a LLaMA checkpoint into model.norm_scheme="
                         f"{NormScheme(cfg.norm_scheme).value}, norm_type={cfg.norm_type}: " + "; ".join(problems))
    as_trained = as_trained or {}
    padded = cfg.padded_vocab_size(1)
    head = hf.get("lm_head.weight")
    state = {"embedding.word_embeddings.weight": fit_rows(hf["model.embed_tokens.weight"], padded),
             "output.final_norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        if head is None:
            raise ValueError("the Hugging Face checkpoint has tied embeddings (no lm_head.weight) but "
                             "model.tie_embeddings is false; set model.tie_embeddings: true")
        state["output.head.weight"] = fit_rows(head, padded)
    for index in range(cfg.num_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        norm_factor, output_factor = factors[index] if factors else (1.0, 1.0)
        q, k, v = (hf[theirs + f"self_attn.{p}_proj.weight"] for p in "qkv")
        if cfg.fused_qkv:
            state[ours + "attention.qkv_proj.weight"] = torch.cat([q, k, v])
        else:
            state.update({ours + f"attention.{p}_proj.weight": w for p, w in zip("qkv", (q, k, v))})
        unfolded = {name: unfold(hf[theirs + name], factor, as_trained.get(theirs + name))
                    for name, factor in (("input_layernorm.weight", norm_factor),
                                         ("post_attention_layernorm.weight", norm_factor),
                                         ("self_attn.o_proj.weight", output_factor),
                                         ("mlp.down_proj.weight", output_factor))}
        state.update({
            ours + "attention_norm.weight": unfolded["input_layernorm.weight"],
            ours + "mlp_norm.weight": unfolded["post_attention_layernorm.weight"],
            ours + "attention.o_proj.weight": unfolded["self_attn.o_proj.weight"],
            ours + "mlp.gate_up_proj.weight": torch.cat([hf[theirs + "mlp.gate_proj.weight"],
                                                         hf[theirs + "mlp.up_proj.weight"]]),
            ours + "mlp.down_proj.weight": unfolded["mlp.down_proj.weight"],
        })
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def hf_config(cfg: ModelConfig, dtype: str, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """A ``LlamaConfig``-compatible config.json (keys for transformers 4.x and 5.x), with lnstrain's record
    of what it folded (``lns_fold``)."""
    torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.num_layers, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "torch_dtype": torch_dtype,
        "dtype": torch_dtype, "use_cache": True, RECORD_KEY: fold_record(cfg),
    }
    if bos_id is not None and bos_id >= 0:
        config["bos_token_id"] = bos_id
    if eos_id is not None and eos_id >= 0:
        config["eos_token_id"] = eos_id
    return config


def config_problems(hf: dict, cfg: ModelConfig) -> list[str]:
    """Differences between a Hugging Face config.json and lnstrain's model config."""
    pairs = [("hidden_size", cfg.hidden_size, "hidden_size"), ("intermediate_size", cfg.ffn_hidden_size, "ffn_hidden_size"),
             ("num_attention_heads", cfg.num_heads, "num_heads"), ("num_hidden_layers", cfg.num_layers, "num_layers"),
             ("num_key_value_heads", cfg.kv_heads, "num_kv_heads"), ("vocab_size", cfg.vocab_size, "vocab_size"),
             ("tie_word_embeddings", cfg.tie_embeddings, "tie_embeddings")]
    problems = []
    for theirs, ours, key in pairs:
        value = hf.get(theirs, hf.get("num_attention_heads") if theirs == "num_key_value_heads" else None)
        if value != ours:
            problems.append(f"config.json {theirs}={value} but model.{key}={ours}")
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    if float(rope) != float(cfg.rope_theta):
        problems.append(f"config.json rope_theta={rope} but model.rope_theta={cfg.rope_theta}")
    if (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        problems.append("config.json uses rope scaling, which lnstrain's rotary embedding does not implement")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append("config.json has attention or MLP biases; lnstrain's LLaMA has none")
    if abs(float(hf.get("rms_norm_eps", cfg.norm_eps)) - cfg.norm_eps) > 0:
        logger.warning("config.json rms_norm_eps=%s differs from model.norm_eps=%s", hf.get("rms_norm_eps"), cfg.norm_eps)
    return problems


def shards_by_size(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors, each at most ``max_bytes`` (a bigger tensor alone)."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard
