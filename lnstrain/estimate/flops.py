"""Training FLOPs per token, from the model's shapes.

Conventions (dense matmuls only; norms, softmax, rotary and the loss are ignored):

* ``N`` = parameters that take part in a matmul: every parameter except the input embedding table,
  plus the output head (``V·h``; it is computed even when tied to the embedding). A matmul with
  ``n`` weights costs ``2n`` FLOPs per token forward and ``4n`` backward: ``6N`` per token.
* Attention scores (``QKᵀ``) and the weighted sum (``AV``) cost ``2·s·h`` FLOPs per token per layer
  each, forward; with backward ×3: ``12·L·h·s``. This is the Megatron-LM / PaLM / torchtitan
  convention, which counts the full ``s×s`` matrix (non-causal).
* A causal kernel computes about half of that matrix: ``6·L·h·s``.

MFU is quoted against the non-causal convention (the usual one). Recomputation (activation
checkpointing) adds hardware FLOPs but not model FLOPs, so it does not change these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from lnstrain.model.config import ModelConfig


@dataclass(frozen=True)
class FlopsPerToken:
    """Training (forward + backward) FLOPs per token.

    Attributes:
        matmul_params: N, the parameters used in matmuls (see the module docstring).
        dense: 6·N.
        attention_noncausal: 12·L·h·s (Megatron / torchtitan convention).
        attention_causal: 6·L·h·s.
    """

    matmul_params: int
    dense: int
    attention_noncausal: int
    attention_causal: int

    @property
    def noncausal(self) -> int:
        """6N + 12·L·h·s: the convention MFU is quoted in."""
        return self.dense + self.attention_noncausal

    @property
    def causal(self) -> int:
        """6N + 6·L·h·s."""
        return self.dense + self.attention_causal


def matmul_parameters(model: ModelConfig) -> int:
    """Parameters that take part in a matmul: non-embedding parameters plus the output head."""
    return model.num_parameters(include_embeddings=False) + model.vocab_size * model.hidden_size


def flops_per_token(model: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Training FLOPs per token for sequences of ``seq_len`` tokens."""
    n = matmul_parameters(model)
    attention_width = model.num_heads * model.head_dim
    attention = 12 * model.num_layers * attention_width * seq_len
    return FlopsPerToken(matmul_params=n, dense=6 * n, attention_noncausal=attention,
                         attention_causal=attention // 2)


FLOPS_FORMULA = ("6·N + 12·L·h·s (Megatron/torchtitan, non-causal attention) or 6·N + 6·L·h·s (causal), "
                 "N = non-embedding parameters + output head V·h")
