"""The LLaMA-family decoder: embedding -> layers -> final norm -> output head.

Each stage is a module of its own, passing plain tensors, so that a pipeline (``model.pipeline``)
can place them on different ranks; ``Transformer`` chains them on one. Hidden states are
[batch, seq, hidden] (seq sharded under sequence parallelism); logits are [batch, seq, padded_vocab / tp].
Building any of them creates no process group (see ``model.build``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lnstrain.model.block import TransformerBlock
from lnstrain.model.config import ModelConfig
from lnstrain.model.init import init_weights
from lnstrain.model.loss import language_model_loss
from lnstrain.model.norm_schemes import has_final_norm
from lnstrain.model.norms import build_norm
from lnstrain.parallel.layers import ColumnParallelLinear, OutputPart, VocabParallelEmbedding, vocab_parallel_logits
from lnstrain.parallel.sequence_parallel import sequence_parallel_params

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


class EmbeddingStage(nn.Module):
    """tokens [batch, seq] -> hidden states."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.init_prefix = "embedding"
        self.word_embeddings = VocabParallelEmbedding(cfg.padded_vocab_size(groups.tp_size), cfg.hidden_size, groups)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        init_weights(self, cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.word_embeddings(tokens))


class OutputStage(nn.Module):
    """hidden states -> final norm -> this rank's vocabulary logits.

    With tied embeddings the stage owns no head: pass the embedding's weight to forward.
    Post-LN and DeepNorm blocks end in a norm, so their final norm is the identity.
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.init_prefix = "output"
        self.groups = groups
        self.final_norm = build_norm(cfg) if has_final_norm(cfg.norm_scheme) else nn.Identity()
        padded = cfg.padded_vocab_size(groups.tp_size)
        self.head = None if cfg.tie_embeddings else ColumnParallelLinear(
            cfg.hidden_size, [OutputPart("vocab", padded, padded)], groups)
        init_weights(self, cfg)

    def normalize(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm (its gain's gradient summed over the tensor group under sequence parallelism)."""
        params = sequence_parallel_params({"final_norm": self.final_norm}, self.groups)
        return self.final_norm(hidden, *params.get("final_norm", ()))

    def forward(self, hidden: torch.Tensor, tied_embedding_weight: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.normalize(hidden)
        if self.head is not None:
            return self.head(hidden)
        if tied_embedding_weight is None:
            raise ValueError("tied embeddings: OutputStage.forward needs the embedding weight")
        return vocab_parallel_logits(hidden, tied_embedding_weight, self.groups)


class Transformer(nn.Module):
    """The whole model in one module: what each rank holds at pipeline size 1."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        problems = cfg.validate(groups.tp_size)
        if problems:
            raise ValueError("invalid model config:\n  " + "\n  ".join(problems))
        self.cfg = cfg
        self.groups = groups
        self.embedding = EmbeddingStage(cfg, groups)
        self.layers = nn.ModuleList(TransformerBlock(cfg, number, groups) for number in range(1, cfg.num_layers + 1))
        self.output = OutputStage(cfg, groups)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, padded_vocab / tp]."""
        hidden = self.embedding(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        tied = self.embedding.word_embeddings.weight if self.cfg.tie_embeddings else None
        return self.output(hidden, tied)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of predicting labels[b, t] from tokens[b, :t+1]."""
        return language_model_loss(self(tokens), labels, self.cfg, self.groups, loss_mask)

    def set_activation_checkpointing(self, mode: str | bool) -> None:
        """``none``, ``full`` or ``selective`` (see ``TransformerBlock``); True means ``full``."""
        if isinstance(mode, bool):
            mode = "full" if mode else "none"
        for layer in self.layers:
            layer.set_activation_checkpointing(mode)
