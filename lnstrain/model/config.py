"""The model's configuration: one typed dataclass, validated all at once.

Plain types, str-Enums and Literals only, so the generic YAML loader can fill it. The norm schemes
(``NormScheme``) and what each implies live in ``norm_schemes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lnstrain.model.norm_schemes import NormScheme, has_final_norm, norms_per_block


@dataclass
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = None
    """Grouped-query attention; None means num_heads (plain multi-head attention)."""
    ffn_hidden_size: int = 11008
    """Width of the SwiGLU MLP (after rounding up to ``ffn_multiple_of``)."""
    ffn_multiple_of: int = 1
    """Round ``ffn_hidden_size`` up to a multiple of this (LLaMA's ``multiple_of``, 256 there): a width
    that is a multiple of 64 or more keeps the MLP's matrix products on full tensor-core tiles and lets
    it split over tensor ranks. The resolved config records the rounded width."""
    max_seq_len: int = 2048
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    norm_scheme: NormScheme = NormScheme.PRE_LN
    mix_ln_alpha: float = 0.25
    """Mix-LN: fraction of the (first) layers that use Post-LN."""
    layerscale_init: float | None = None
    """LayerScale: initial gain; None means the CaiT rule on num_layers."""
    scaled_init: bool = False
    """Output projections (attention out, MLP down) drawn with std init_std / sqrt(2 * num_layers)."""
    init_std: float = 0.02
    init_seed: int = 1234
    """Seed of the deterministic weight init (identical for every parallel layout)."""
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    fused_qkv: bool = True
    make_vocab_size_divisible_by: int = 128
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """The SDPA kernel attention runs: ``auto`` prefers cuDNN's on Hopper GPUs (compute capability 9),
    then flash, memory-efficient and math as each fits, and leaves the choice to torch elsewhere; a named
    kernel is the only one allowed (torch raises where it cannot run the shapes or dtype)."""
    cross_entropy: Literal["chunked", "fp32_logits"] = "chunked"
    """How the loss computes its cross-entropy (``lnstrain.parallel.cross_entropy``), in fp32 either way:
    ``chunked`` (the default) reads the 16-bit logits chunk by chunk and keeps only them and an fp32
    log-sum-exp per token for backward, which writes the logits' gradient over them;
    ``fp32_logits``, the implementation it replaced, kept for reference and for the benchmark's
    comparison, holds fp32 log-probabilities (and, from bf16 logits, an fp32 copy while computing them):
    8 bytes per logit more at the forward's peak (10 against 2 and a chunk). Read at every call, so it
    may be switched on a built model."""

    EXECUTION_ONLY_KEYS = frozenset({"attention_backend", "cross_entropy"})
    """Keys that choose how the same model is computed, not what it computes: a run may change them on resume."""

    def __post_init__(self) -> None:
        if isinstance(self.ffn_multiple_of, int) and isinstance(self.ffn_hidden_size, int) and self.ffn_multiple_of > 1:
            self.ffn_hidden_size = -(-self.ffn_hidden_size // self.ffn_multiple_of) * self.ffn_multiple_of
        if isinstance(self.norm_scheme, str) and not isinstance(self.norm_scheme, NormScheme):
            try:
                self.norm_scheme = NormScheme(self.norm_scheme)
            except ValueError:
                pass  # reported by validate()

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * tensor_parallel."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self, tensor_parallel: int = 1) -> list[str]:
        """Every problem with this config, each naming the key to change; empty when valid."""
        problems: list[str] = []
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "ffn_multiple_of",
                    "max_seq_len", "make_vocab_size_divisible_by"):
            if getattr(self, key) <= 0:
                problems.append(f"model.{key} ({getattr(self, key)}) must be positive")
        if self.num_heads > 0 and self.hidden_size % self.num_heads:
            problems.append(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                            f"model.num_heads ({self.num_heads})")
        elif self.num_heads > 0 and self.head_dim % 2:
            problems.append(f"model.hidden_size / model.num_heads ({self.head_dim}) must be even for rotary embeddings")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            problems.append(f"model.num_kv_heads ({self.num_kv_heads}) must be positive and divide "
                            f"model.num_heads ({self.num_heads})")
        if self.norm_type not in ("rmsnorm", "layernorm"):
            problems.append(f"model.norm_type ({self.norm_type!r}) must be 'rmsnorm' or 'layernorm'")
        if not isinstance(self.norm_scheme, NormScheme):
            problems.append(f"model.norm_scheme ({self.norm_scheme!r}) must be one of "
                            f"{[s.value for s in NormScheme]}")
        if self.norm_eps <= 0:
            problems.append(f"model.norm_eps ({self.norm_eps}) must be positive")
        if not 0.0 <= self.mix_ln_alpha <= 1.0:
            problems.append(f"model.mix_ln_alpha ({self.mix_ln_alpha}) must be in [0, 1]")
        if self.layerscale_init is not None and self.layerscale_init <= 0:
            problems.append(f"model.layerscale_init ({self.layerscale_init}) must be positive")
        if self.init_std <= 0:
            problems.append(f"model.init_std ({self.init_std}) must be positive")
        if self.rope_theta <= 0:
            problems.append(f"model.rope_theta ({self.rope_theta}) must be positive")
        for key in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                problems.append(f"model.{key} ({getattr(self, key)}) must be in [0, 1)")
        if tensor_parallel > 1:
            problems += self._tensor_parallel_problems(tensor_parallel)
        return problems

    def _tensor_parallel_problems(self, tp: int) -> list[str]:
        problems = []
        if self.num_heads % tp:
            problems.append(f"model.num_heads ({self.num_heads}) must be divisible by "
                            f"parallel.tensor ({tp})")
        if self.num_kv_heads is not None and self.kv_heads % tp and tp % self.kv_heads:  # unset: num_heads's line
            problems.append(f"model.num_kv_heads ({self.kv_heads}) must divide or be divisible by "
                            f"parallel.tensor ({tp})")
        if self.ffn_hidden_size % tp:
            problems.append(f"model.ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                            f"parallel.tensor ({tp}); model.ffn_multiple_of: 256 rounds it up (LLaMA's rule)")
        for key in ("attention_dropout", "hidden_dropout"):
            if getattr(self, key) > 0:
                problems.append(f"model.{key} ({getattr(self, key)}) must be 0 with parallel.tensor > 1: "
                                "tensor-parallel dropout needs an RNG tracker, which lnstrain lacks")
        return problems

    def num_parameters(self, include_embeddings: bool = True, tensor_parallel: int | None = None) -> int:
        """Parameter count from the shapes alone (no model needed).

        Embeddings use the true vocabulary, or the padded one when tensor_parallel is given.
        """
        h, head_dim = self.hidden_size, self.head_dim
        norm_size = h * (2 if self.norm_type == "layernorm" else 1)
        attention = h * self.num_heads * head_dim + 2 * h * self.kv_heads * head_dim + self.num_heads * head_dim * h
        mlp = 3 * h * self.ffn_hidden_size
        layerscale = 2 * h if self.norm_scheme == NormScheme.LAYERSCALE else 0
        block = attention + mlp + layerscale + norms_per_block(self.norm_scheme) * norm_size
        total = self.num_layers * block + (norm_size if has_final_norm(self.norm_scheme) else 0)
        if include_embeddings:
            vocab = self.vocab_size if tensor_parallel is None else self.padded_vocab_size(tensor_parallel)
            total += vocab * h * (1 if self.tie_embeddings else 2)
        return total

    @property
    def num_non_embedding_parameters(self) -> int:
        return self.num_parameters(include_embeddings=False)
