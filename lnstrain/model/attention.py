"""Causal grouped-query self-attention with rotary embeddings, heads split across
tensor-parallel ranks.

Query heads are split evenly. Key/value heads are split too when there are at least as
many as ranks; otherwise each rank holds the one KV head its query heads use (replicated), and
the `kv_head_copies` neighbouring ranks sharing a head sum its gradient in backward, over a group
that must exist before the model is built (`ParallelGroups.build(..., tp_replica_copies=...)`).

`checkpoint_core` (selective activation checkpointing) recomputes the attention core,
softmax(q k^T) v, in backward instead of keeping what it saves: the inputs q, k, v are kept.

Under context parallelism (``groups.cp_size`` > 1) each rank holds two chunks of the sequence; q and k
are rotated at their global positions, and the core is exact over the whole sequence: ring attention
(``parallel.ring_attention``) or, with ``context_method: all_to_all``, SDPA over the whole sequence for
a share of the heads between two all-to-alls (``parallel.all_to_all_attention``).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from lnstrain.model.config import ModelConfig
from lnstrain.model.rotary import RotaryEmbedding
from lnstrain.parallel.all_to_all_attention import heads_to_sequence, sequence_to_heads
from lnstrain.parallel.context import local_positions
from lnstrain.parallel.layers import ColumnParallelLinear, OutputPart, RowParallelLinear
from lnstrain.parallel.mappings import enter_tp_region
from lnstrain.parallel.ring_attention import ring_attention

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups


SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""``model.attention_backend``'s names for torch's SDPA kernels."""
HOPPER_PREFERENCE = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]
"""``auto`` on compute capability 9: cuDNN's fused attention first (faster than FlashAttention-2 on
Hopper in torch's and NVIDIA's measurements), each next kernel where the previous cannot run."""


_PRIORITY = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}
"""``sdpa_kernel``'s ``set_priority`` (torch 2.6+): the list's order is the order tried, not only the set allowed."""


def sdpa_backends(choice: str, device_type: str) -> list[SDPBackend] | None:
    """The SDPA kernels ``model.attention_backend`` allows on ``device_type``, in order of preference;
    None leaves the choice to torch."""
    if choice != "auto":
        return [SDPA_BACKENDS[choice]]
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return list(HOPPER_PREFERENCE)
    return None


def kv_head_copies(cfg: ModelConfig, tp_size: int) -> int:
    """How many neighbouring tensor ranks hold each key/value head: tp / num_kv_heads when there are
    fewer KV heads than ranks, else 1 (each rank holds its own)."""
    if cfg.kv_heads >= tp_size or tp_size % cfg.kv_heads:
        return 1
    return tp_size // cfg.kv_heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        tp = groups.tp_size
        copies = kv_head_copies(cfg, tp)
        if copies > 1 and groups.tp_group is not None:
            groups.tp_replica_group(copies)  # raises, naming the fix, when that group was not built
        self.groups = groups
        self.head_dim = cfg.head_dim
        self.local_heads = cfg.num_heads // tp
        self.local_kv_heads = max(cfg.kv_heads // tp, 1)
        self.dropout = cfg.attention_dropout
        self.checkpoint_core = False
        self.sdpa_backends = sdpa_backends(cfg.attention_backend, "cpu")
        """SDPA's allowed kernels in order (None: torch's choice); ``build_model`` sets them for the device."""

        q = OutputPart("q", cfg.num_heads * cfg.head_dim, cfg.num_heads)
        k = OutputPart("k", cfg.kv_heads * cfg.head_dim, cfg.kv_heads)
        v = OutputPart("v", cfg.kv_heads * cfg.head_dim, cfg.kv_heads)
        if cfg.fused_qkv:
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, k, v], groups, input_in_region=True)
        else:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, [q], groups, input_in_region=True)
            self.k_proj = ColumnParallelLinear(cfg.hidden_size, [k], groups, input_in_region=True)
            self.v_proj = ColumnParallelLinear(cfg.hidden_size, [v], groups, input_in_region=True)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, groups, name="o")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.uses_ring = groups.cp_size > 1 and groups.context_method == "ring"
        self.uses_all_to_all = groups.cp_size > 1 and groups.context_method == "all_to_all"

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q and k (at their global positions), and v, each [batch, seq, heads, head_dim]."""
        batch, seq, _ = x.shape
        positions = local_positions(seq, self.groups)
        if hasattr(self, "qkv_proj"):
            return self.rotary.fused_qkv(self.qkv_proj(x), self.local_heads, self.local_kv_heads, positions)
        q = self.q_proj(x).view(batch, seq, self.local_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.local_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.local_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, positions)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] (sequence-sharded under sequence parallelism; this rank's two chunks
        under context parallelism)."""
        x = enter_tp_region(x, self.groups)
        batch, seq, _ = x.shape
        q, k, v = self._project(x)
        if self.uses_all_to_all:  # the whole sequence, 1/N of the heads
            q, k, v = sequence_to_heads(q, k, v, self.groups)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.checkpoint_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        out = out.transpose(1, 2)
        if self.uses_all_to_all:
            out = heads_to_sequence(out, self.groups)
        return self.o_proj(out.reshape(batch, seq, self.local_heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v over [batch, heads, seq, head_dim]: on ``sdpa_backends``, or
        by ring attention across the context group."""
        if self.uses_ring:
            return ring_attention(q, k, v, self.groups)
        if self.sdpa_backends is None:
            return self._sdpa(q, k, v)
        with sdpa_kernel(self.sdpa_backends, **_PRIORITY):
            return self._sdpa(q, k, v)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.local_kv_heads != self.local_heads,
        )
