"""The ``--dry-run`` report: what a run would be, without allocating it.

The model is built on the meta device (shapes only), its parameters are counted and checked
against ``ModelConfig.num_parameters()``; FLOPs, the token budget, the per-rank memory for the
configured layout and the derived DeepSpeed JSON are added. Runs for the 7B config in seconds.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from lnstrain.config.deepspeed_json import deepspeed_config
from lnstrain.config.loader import ConfigError
from lnstrain.config.run_config import Config
from lnstrain.estimate.flops import FLOPS_FORMULA, flops_per_token
from lnstrain.estimate.memory import (CHECKPOINTING_MODES, GIB, korthikanti_gpt_layer_bytes, memory_estimate,
                                      unmodelled_buffers_note)
from lnstrain.estimate.validation import split_file_problems
from lnstrain.model.transformer import Transformer
from lnstrain.parallel.groups import ParallelGroups


def meta_parameter_count(config: Config) -> int:
    """Parameters of the single-process model built on the meta device (padded vocabulary)."""
    with torch.device("meta"):
        model = Transformer(config.model, ParallelGroups.single_process())
    return sum(p.numel() for p in model.parameters())


def dry_run_summary(config: Config, world_size: int) -> dict[str, Any]:
    """Everything the dry run reports, as JSON-able data.

    Raises ``ConfigError`` for config problems (missing data files only become ``notes``) and
    ``RuntimeError`` if the meta model's parameter count disagrees with the formula.
    """
    problems, missing_files = split_file_problems(config, world_size)
    if problems:
        raise ConfigError(problems, f"{config.run.name} (dry run, world size {world_size})")
    model = config.model
    counted = meta_parameter_count(config)
    formula_padded = model.num_parameters(tensor_parallel=1)
    if counted != formula_padded:
        raise RuntimeError(f"the meta model has {counted:,} parameters but ModelConfig.num_parameters"
                           f"(tensor_parallel=1) gives {formula_padded:,}: the formula and the model disagree")
    seq_len = config.data.seq_len
    flops = flops_per_token(model, seq_len)
    steps = config.total_steps
    tokens = steps * config.tokens_per_step
    memory = memory_estimate(config, world_size)
    heaviest = memory.heaviest
    return {
        "run": config.run.name,
        "world_size": world_size,
        "layout": {
            "tensor": memory.tensor, "pipeline": memory.pipeline, "data": memory.data,
            "zero_stage": memory.zero_stage, "sequence_parallel": config.parallel.sequence_parallel,
            "micro_batch_size": config.train.micro_batch_size,
            "grad_accumulation_steps": config.grad_accumulation_steps(world_size),
            "activation_checkpointing": config.train.activation_checkpointing,
        },
        "parameters": {
            "total": model.num_parameters(),
            "non_embedding": model.num_parameters(include_embeddings=False),
            "meta_model_padded_vocab": counted,
            "padded_vocab_size": model.padded_vocab_size(1),
        },
        "flops_per_token": {
            "formula": FLOPS_FORMULA, "matmul_params": flops.matmul_params,
            "noncausal": flops.noncausal, "causal": flops.causal,
        },
        "budget": {
            "seq_len": seq_len, "global_batch_size": config.train.global_batch_size,
            "tokens_per_step": config.tokens_per_step, "total_steps": steps,
            "warmup_steps": config.warmup_steps, "total_tokens": tokens,
            "total_flops_noncausal": flops.noncausal * tokens, "total_flops_causal": flops.causal * tokens,
        },
        "memory_per_rank": {
            "heaviest_stage": heaviest.stage, "stage_layers": heaviest.layers,
            "parameters_on_rank": heaviest.parameters,
            "weights_bytes": heaviest.weights, "gradients_bytes": heaviest.gradients,
            "optimizer_bytes": heaviest.optimizer,
            "step_gradients_bytes": heaviest.step_gradients, "deepspeed_buffers_bytes": heaviest.buffers,
            "activations_bytes": dict(heaviest.activations),
            "total_bytes": memory.total,
            "total_bytes_by_checkpointing": {mode: memory.total_with(mode) for mode in CHECKPOINTING_MODES},
            "korthikanti_gpt_layer_bytes": korthikanti_gpt_layer_bytes(model, seq_len, config.train.micro_batch_size),
        },
        "deepspeed_config": deepspeed_config(config, world_size),
        "notes": [f"{note} (ignored by the dry run; needed by the real run)" for note in missing_files]
                 + [note for note in [unmodelled_buffers_note(config, world_size, memory)] if note],
    }


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.0f}"


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:8.2f} GiB"


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable report of a ``dry_run_summary``."""
    lay, par, fl, bud, mem = (summary[k] for k in ("layout", "parameters", "flops_per_token", "budget",
                                                   "memory_per_rank"))
    ckpt = lay["activation_checkpointing"]
    lines = [
        f"Dry run of '{summary['run']}' on {summary['world_size']} rank(s)",
        f"  layout: tensor {lay['tensor']} × pipeline {lay['pipeline']} × data {lay['data']}, ZeRO stage "
        f"{lay['zero_stage']}, sequence parallel {lay['sequence_parallel']}, micro-batch "
        f"{lay['micro_batch_size']} × {lay['grad_accumulation_steps']} accumulation steps, "
        f"activation checkpointing {ckpt}",
        "Parameters",
        f"  total:          {par['total']:>16,} ({_count(par['total'])})",
        f"  non-embedding:  {par['non_embedding']:>16,} ({_count(par['non_embedding'])})",
        f"  meta model:     {par['meta_model_padded_vocab']:>16,} (vocabulary padded to "
        f"{par['padded_vocab_size']}; matches ModelConfig.num_parameters)",
        "Training FLOPs per token",
        f"  formula: {fl['formula']}",
        f"  non-causal (MFU convention): {fl['noncausal']:,} ({_count(fl['noncausal'])})",
        f"  causal:                      {fl['causal']:,} ({_count(fl['causal'])})",
        "Token budget",
        f"  tokens per step: {bud['tokens_per_step']:,} (global batch {bud['global_batch_size']} × "
        f"sequence {bud['seq_len']})",
        f"  total steps:     {bud['total_steps']:,} (warmup {bud['warmup_steps']:,})",
        f"  total tokens:    {bud['total_tokens']:,} ({_count(bud['total_tokens'])})",
        f"  total FLOPs:     {bud['total_flops_noncausal']:.3e} non-causal, "
        f"{bud['total_flops_causal']:.3e} causal",
        f"Memory per rank (pipeline stage {mem['heaviest_stage']}, {mem['stage_layers']} layers, "
        f"{mem['parameters_on_rank']:,} parameters on the rank)",
        f"  weights:      {_gib(mem['weights_bytes'])}",
        f"  gradients:    {_gib(mem['gradients_bytes'])}",
        f"  optimizer:    {_gib(mem['optimizer_bytes'])} (fp32 master + Adam moments, ZeRO stage "
        f"{lay['zero_stage']})",
    ]
    if mem["step_gradients_bytes"]:
        lines.append(f"  gradients at the step: {_gib(mem['step_gradients_bytes'])} (DeepSpeed's fp32 copies and "
                     "all-reduce buckets, instead of the activations)")
    if mem["deepspeed_buffers_bytes"]:
        lines.append(f"  DeepSpeed buffers: {_gib(mem['deepspeed_buffers_bytes'])} (ZeRO reduce bucket; "
                     "deepspeed.zero_optimization.reduce_bucket_size)")
    for mode in CHECKPOINTING_MODES:
        marker = "  <- configured" if mode == ckpt else ""
        lines.append(f"  activations, checkpointing {mode:<9} {_gib(mem['activations_bytes'][mode])}"
                     f"  (total {_gib(mem['total_bytes_by_checkpointing'][mode]).strip()}){marker}")
    lines += [
        f"  total:        {_gib(mem['total_bytes'])} (without the CUDA context, fragmentation and "
        f"NCCL's own buffers)",
        "  activation formula: Korthikanti et al. 2022 adapted to the LLaMA block with SDPA/flash "
        "attention (no s×s scores stored); see lnstrain/estimate/memory.py. Reference GPT block "
        f"s·b·h·(34 + 5·a·s/h) = {_gib(mem['korthikanti_gpt_layer_bytes']).strip()} per layer",
        "DeepSpeed config",
        *("  " + line for line in json.dumps(summary["deepspeed_config"], indent=2).splitlines()),
    ]
    if summary["notes"]:
        lines += ["Notes", *(f"  - {note}" for note in summary["notes"])]
    return "\n".join(lines)


def dry_run_report(config: Config, world_size: int) -> str:
    """The text ``launch/pretrain.py --dry-run`` prints (raises like ``dry_run_summary``)."""
    return format_summary(dry_run_summary(config, world_size))
