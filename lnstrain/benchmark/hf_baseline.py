"""The baseline: Hugging Face ``LlamaForCausalLM`` of the same shape, driven like ``ModelRunner``.

Same shape means the same hidden, FFN, layer, head and KV-head sizes, the same (padded) vocabulary,
tied or untied head, norm epsilon and rotary base; SDPA attention; torch's AdamW with the same
hyper-parameters; the loss is fp32 cross-entropy over the logits, as lnstrain computes it.
``transformers`` is an optional extra (``pip install 'lnstrain[hf]'``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lnstrain.benchmark.runners import PlainRunner
from lnstrain.config.feasibility import compiles_layers
from lnstrain.config.run_config import Config
from lnstrain.model.config import ModelConfig, NormScheme

MISSING_TRANSFORMERS = ("the Hugging Face baseline needs transformers: pip install 'lnstrain[hf]' "
                        "(or pip install 'transformers>=4.40'), or run with --baseline none")


class BaselineUnavailable(RuntimeError):
    """The baseline cannot run here (transformers missing, or the shape has no LLaMA equivalent)."""


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def llama_config_kwargs(model: ModelConfig) -> dict[str, Any]:
    """``LlamaConfig`` keyword arguments for lnstrain's shape (padded vocabulary, as lnstrain computes)."""
    if model.norm_type != "rmsnorm":
        raise BaselineUnavailable(f"model.norm_type {model.norm_type!r}: LLaMA uses RMSNorm")
    if NormScheme(model.norm_scheme) not in (NormScheme.PRE_LN, NormScheme.LNS):
        raise BaselineUnavailable(f"model.norm_scheme {model.norm_scheme.value!r}: the LLaMA baseline is "
                                  "Pre-LN; compare lns or pre_ln")
    return dict(vocab_size=model.padded_vocab_size(1), hidden_size=model.hidden_size,
                intermediate_size=model.ffn_hidden_size, num_hidden_layers=model.num_layers,
                num_attention_heads=model.num_heads, num_key_value_heads=model.kv_heads,
                max_position_embeddings=model.max_seq_len, rms_norm_eps=model.norm_eps,
                rope_theta=model.rope_theta, tie_word_embeddings=model.tie_embeddings,
                initializer_range=model.init_std, attention_dropout=model.attention_dropout,
                attention_bias=False, mlp_bias=False, hidden_act="silu")


def build_hf_model(model: ModelConfig) -> torch.nn.Module:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        raise BaselineUnavailable(MISSING_TRANSFORMERS) from error
    hf_config = LlamaConfig(**llama_config_kwargs(model))
    hf_config._attn_implementation = "sdpa"
    return LlamaForCausalLM(hf_config)


class HFRunner(PlainRunner):
    """``LlamaForCausalLM`` + torch AdamW; compile and full checkpointing mirror the config."""

    kind = "hf"

    def __init__(self, name: str, config: Config, device: torch.device,
                 micro_batches: list[dict[str, torch.Tensor]]) -> None:
        mode = config.train.activation_checkpointing
        if mode == "selective":
            raise BaselineUnavailable("train.activation_checkpointing: 'selective' has no transformers "
                                      "equivalent; the baseline runs 'none' or 'full'")
        model = build_hf_model(config.model)
        if mode == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiles_layers(config, device.type):
            for layer in model.model.layers:
                layer.compile(backend=config.train.compile_backend)
        self.vocab_size = config.model.vocab_size
        super().__init__(name, model, config, device, micro_batches)

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits[..., :self.vocab_size].float().flatten(0, 1), labels.flatten())
