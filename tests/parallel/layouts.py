"""Shared pieces of the layout tests: configs, deterministic global batches, gradient gathering,
and the rank functions the spawned processes run (importable, so spawn can find them).

Every run builds engines with ``build_engine`` and trains on the same global batches; only how
the batch is cut (data-parallel ranks, micro-batches) and how the model is split differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lnstrain.config.run_config import Config
from lnstrain.data.config import DataConfig
from lnstrain.model import model_preset
from lnstrain.parallel.config import ParallelConfig
from lnstrain.training.config import OptimConfig, PrecisionConfig, TrainConfig

SEQ_LEN = 16
VOCAB = 100
GLOBAL_BATCH = 8
MICRO_BATCH = 2
STEPS = 10


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout of the parity matrix."""

    name: str
    tensor: int = 1
    pipeline: int = 1
    zero_stage: int = 0
    boundaries: tuple[int, ...] | None = None
    partition: str = "parameters"
    tied: bool = False
    checkpointing: str = "none"
    dtype: str = "fp32"
    sequence_parallel: bool = False
    kv_heads: int = 2
    fused_qkv: bool = True
    context: int = 1
    context_method: str = "ring"
    fp8: str = "none"
    fp8_in_place: str = "none"
    """Switch the built engine's blocks to this float8 mode (``set_fp8_mode``), whatever the dtype: fp32
    engines then check float8's parity without bf16's rounding."""
    fp8_context_scales: bool = True
    """False: the control that leaves float8's MAX all-reduces over the context group out (each context
    rank scales by the maxima of its own tokens)."""

    def config(self, steps: int = STEPS) -> Config:
        return make_config(self, steps)

    @property
    def reference(self) -> "Layout":
        """The single-process layout with this one's model (and float8 mode, switched in place)."""
        return Layout(f"reference{'_tied' if self.tied else ''}_kv{self.kv_heads}{'' if self.fused_qkv else '_separate'}"
                      f"{'' if self.fp8_in_place == 'none' else '_fp8_' + self.fp8_in_place}",
                      tied=self.tied, kv_heads=self.kv_heads, fused_qkv=self.fused_qkv, fp8_in_place=self.fp8_in_place)


def make_config(layout: Layout, steps: int = STEPS, num_layers: int = 6) -> Config:
    model = model_preset("tiny", norm_scheme="lns", num_layers=num_layers, tie_embeddings=layout.tied,
                         num_kv_heads=layout.kv_heads, fused_qkv=layout.fused_qkv)
    return Config(
        model=model, data=DataConfig(seq_len=SEQ_LEN),
        parallel=ParallelConfig(tensor=layout.tensor, pipeline=layout.pipeline, zero_stage=layout.zero_stage,
                                pipeline_partition=layout.partition, sequence_parallel=layout.sequence_parallel,
                                context=layout.context, context_method=layout.context_method,
                                pipeline_boundaries=list(layout.boundaries) if layout.boundaries else None),
        optim=OptimConfig(name="adamw", lr=3e-3, weight_decay=0.1, warmup_steps=2, grad_clip=1.0),
        train=TrainConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, steps=steps,
                          activation_checkpointing=layout.checkpointing),
        precision=PrecisionConfig(dtype=layout.dtype, fp8=layout.fp8))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [GLOBAL_BATCH, SEQ_LEN + 1] and a loss mask with a different number of counted
    tokens per sample (so a plain mean of micro-batch means would differ from the token mean)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    lengths = torch.randint(SEQ_LEN // 4, SEQ_LEN + 1, (GLOBAL_BATCH, 1), generator=generator)
    loss_mask = (torch.arange(SEQ_LEN).unsqueeze(0) < lengths).float()
    return tokens, loss_mask


def rank_micro_batches(step: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of global batch ``step`` (contiguous shard)."""
    tokens, loss_mask = global_batch(step)
    per_rank = GLOBAL_BATCH // dp_size
    start = dp_rank * per_rank
    return [{"tokens": tokens[i:i + MICRO_BATCH], "loss_mask": loss_mask[i:i + MICRO_BATCH]}
            for i in range(start, start + per_rank, MICRO_BATCH)]


def _stage_prefixes(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(layout-independent name, module) of every model piece on this rank: embedding, layer<l>, output."""
    return [(m.init_prefix, m) for m in module.modules() if hasattr(m, "init_prefix")]


def full_gradients(module: torch.nn.Module, groups: Any, vocab_size: int) -> dict[str, torch.Tensor]:
    """Every gradient this rank's pipeline stage owns, un-sharded over the tensor group, by
    layout-independent name. Call on all ranks at once (tensor-group all-gathers); vocabulary rows
    beyond ``vocab_size`` (padding, which depends on the tensor size) are dropped."""
    from deepspeed.utils import safe_get_full_grad

    from lnstrain.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    sharded_types = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    gradients = {}
    for prefix, piece in _stage_prefixes(module):
        for sub_name, sub in piece.named_modules():
            for param_name, param in sub.named_parameters(recurse=False):
                if getattr(param, "ds_pipe_replicated", False):
                    continue  # the tied embedding's copy on the last stage
                grad = safe_get_full_grad(param).detach().clone().float()
                if isinstance(sub, sharded_types) and groups.tp_size > 1:
                    shards = [torch.empty_like(grad) for _ in range(groups.tp_size)]
                    dist.all_gather(shards, grad.contiguous(), group=groups.tp_group)
                    grad = sub.unshard(shards)
                if isinstance(sub, VocabParallelEmbedding) or (
                        isinstance(sub, ColumnParallelLinear) and any(p.name == "vocab" for p in sub.parts)):
                    grad = grad[:vocab_size]
                name = ".".join(part for part in (prefix, sub_name, param_name) if part)
                gradients[name] = grad
    return gradients


def layer_factors(module: torch.nn.Module) -> list[tuple[int, float]]:
    """(global layer number, LNS factor) of every transformer layer on this rank."""
    from lnstrain.model.block import TransformerBlock

    return [(m.layer_number, m.lns_factor) for m in module.modules() if isinstance(m, TransformerBlock)]


@contextlib.contextmanager
def _float8_scales_without_context_group(leave_out: bool) -> Iterator[None]:
    """While ``leave_out``: the layers' float8 products take no context group (the control's scales)."""
    from lnstrain.parallel import layers

    whole = layers.float8_linear
    if leave_out:
        layers.float8_linear = lambda *args, m_group=None, **kwargs: whole(*args, **kwargs)
    try:
        yield
    finally:
        layers.float8_linear = whole


def train_layout(layout: Layout, world_size: int, steps: int = STEPS) -> dict[str, Any]:
    """Train ``layout`` for ``steps`` steps on this rank; gradients of step 1 from every rank."""
    with _float8_scales_without_context_group(not layout.fp8_context_scales):
        return _train_layout(layout, steps)


def _train_layout(layout: Layout, steps: int) -> dict[str, Any]:
    from lnstrain.model.build import build_groups
    from lnstrain.training.engine import build_engine

    config = layout.config(steps)
    groups = build_groups(config)
    engine = build_engine(config, groups)
    if layout.fp8_in_place != "none":
        from lnstrain.model.build import set_fp8_mode

        set_fp8_mode(engine.module, layout.fp8_in_place)
    captured: dict[str, torch.Tensor] = {}

    def capture() -> None:
        captured.update(full_gradients(engine.module, groups, config.model.vocab_size))

    results = []
    for step in range(steps):
        batches = rank_micro_batches(step, groups.dp_rank, groups.dp_size)
        result = engine.train_step(batches, before_optimizer_step=capture if step == 0 else None)
        results.append(result)
    eval_loss = engine.eval_loss(rank_micro_batches(steps, groups.dp_rank, groups.dp_size))
    keep_gradients = groups.dcp_rank == 0 and groups.tp_rank == 0  # one copy of each gradient
    return {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "lrs": [r.lr for r in results], "skipped": [r.skipped for r in results], "eval_loss": eval_loss,
            "gradients": captured if keep_gradients else {}, "factors": layer_factors(engine.module),
            "coords": (groups.pp_rank, groups.dp_rank, groups.tp_rank)}


def layouts_worker(rank: int, world_size: int, layouts: list[Layout], steps: int) -> dict[str, dict]:
    """Rank function: train each layout in turn (one DeepSpeed import per process for all)."""
    torch.set_num_threads(1)
    return {layout.name: train_layout(layout, world_size, steps) for layout in layouts}


def merge_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One layout's rank results -> rank 0's scalars, every rank's gradients, all factors."""
    merged = dict(per_rank[0])
    merged["gradients"] = {}
    merged["factors"] = []
    for result in per_rank:
        merged["gradients"].update(result["gradients"])
        merged["factors"] += [(result["coords"], factor) for factor in result["factors"]]
    merged["all_losses"] = [result["losses"] for result in per_rank]
    return merged
