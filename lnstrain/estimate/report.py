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
from lnstrain.estimate.memory import (CHECKPOINTING_MODES, GIB, PHASES, gpu_allowances, korthikanti_gpt_layer_bytes,
                                      memory_estimate)
from lnstrain.estimate.snapshot_memory import background_save_refusal
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
    allowances = gpu_allowances(config, world_size)
    return {
        "run": config.run.name,
        "world_size": world_size,
        "layout": {
            "tensor": memory.tensor, "pipeline": memory.pipeline, "data": memory.data,
            "context": memory.context, "context_method": config.parallel.context_method,
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
            "noncausal": flops.noncausal, "causal": flops.causal, "fp8": config.precision.fp8,
        },
        "budget": {
            "seq_len": seq_len, "global_batch_size": config.train.global_batch_size,
            "tokens_per_step": config.tokens_per_step, "total_steps": steps,
            "warmup_steps": config.warmup_steps, "total_tokens": tokens,
            "total_flops_noncausal": flops.noncausal * tokens, "total_flops_causal": flops.causal * tokens,
        },
        "memory_per_rank": {
            "heaviest_stage": heaviest.stage, "stage_layers": heaviest.layers,
            "parameters_on_rank": heaviest.parameters, "deepspeed_optimizer": memory.optimizer_kind,
            "weights_bytes": heaviest.weights, "optimizer_bytes": heaviest.optimizer,
            "persistent_buffers_bytes": heaviest.persistent_buffers, "pipe_buffers_bytes": heaviest.pipe_buffers,
            "held_bytes": heaviest.held, "backward_buffers_bytes": heaviest.backward_buffers,
            "gathered_weights_bytes": heaviest.gathered_weights,
            "accumulated_gradients_bytes": heaviest.accumulated_gradients,
            "activations_bytes": dict(heaviest.activations),
            "loss_forward_transient_bytes": heaviest.forward_transient,
            "backward_transient_bytes": heaviest.backward_transient,
            "recompute_bytes": dict(heaviest.recompute),
            "end_of_backward_bytes": heaviest.gradients, "step_bytes": heaviest.step,
            "phases_bytes": {mode: heaviest.phases(mode) for mode in CHECKPOINTING_MODES},
            "peak_phase": heaviest.peak_phase(memory.checkpointing),
            "total_bytes": memory.total,
            "total_bytes_by_checkpointing": {mode: memory.total_with(mode) for mode in CHECKPOINTING_MODES},
            "gpu_allowances": {"cuda_context_bytes": allowances.cuda_context, "nccl_bytes": allowances.nccl,
                               "allocator_fraction": allowances.allocator_fraction,
                               "workspaces_bytes": allowances.workspaces,
                               "device_total_bytes": allowances.device_total(memory.total)},
            "korthikanti_gpt_layer_bytes": korthikanti_gpt_layer_bytes(model, seq_len, config.train.micro_batch_size),
            "checkpoint_snapshot_host_bytes": memory.snapshot,
            "checkpoint_async_save": _async_save_setting(config),
        },
        "deepspeed_config": deepspeed_config(config, world_size),
        "notes": [f"{note} (ignored by the dry run; needed by the real run)" for note in missing_files],
    }


def _async_save_setting(config: Config) -> str:
    """What ``checkpoint.async_save`` does for this config, in a few words."""
    if config.checkpoint.async_save is False:
        return "off (checkpoint.async_save: false)"
    refusal = background_save_refusal(config)
    if refusal is None:
        return "on"
    return f"{'refused' if config.checkpoint.async_save else 'off'}: {refusal}"


def _mode_note(mode: str, memory: dict[str, Any]) -> str:
    """Why ``selective`` saves so little: with SDPA/flash attention the attention core it recomputes keeps
    only its log-sum-exp; the s×s scores selective recomputation was made for are never stored."""
    if mode != "selective":
        return ""
    saved = memory["activations_bytes"]["none"] - memory["activations_bytes"]["selective"]
    return (f"  (saves {saved / 2**20:,.1f} MiB: it recomputes only the attention core, of which SDPA/flash attention "
            "keeps just the log-sum-exp; the s×s scores it was made for are never stored)")


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
        f"  layout: tensor {lay['tensor']} × pipeline {lay['pipeline']} × data {lay['data']}"
        + (f" × context {lay['context']} ({lay['context_method']}, {bud['seq_len'] // lay['context']} tokens of each "
           f"sequence per rank)" if lay["context"] > 1 else "") + ", ZeRO stage "
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
        *([f"  precision.fp8 {fl['fp8']}: the same FLOPs in float8 linears; MFU against the dense bf16 peak "
           "(torchtitan's convention)"] if fl.get("fp8", "none") != "none" else []),
        "Token budget",
        f"  tokens per step: {bud['tokens_per_step']:,} (global batch {bud['global_batch_size']} × "
        f"sequence {bud['seq_len']})",
        f"  total steps:     {bud['total_steps']:,} (warmup {bud['warmup_steps']:,})",
        f"  total tokens:    {bud['total_tokens']:,} ({_count(bud['total_tokens'])})",
        f"  total FLOPs:     {bud['total_flops_noncausal']:.3e} non-causal, "
        f"{bud['total_flops_causal']:.3e} causal",
        f"Memory per rank (pipeline stage {mem['heaviest_stage']}, {mem['stage_layers']} layers, "
        f"{mem['parameters_on_rank']:,} parameters on the rank; DeepSpeed optimizer {mem['deepspeed_optimizer']}): "
        "live tensors of a steady step, the peak of its phases",
        f"  held between steps: {_gib(mem['held_bytes']).strip()} = weights {_gib(mem['weights_bytes']).strip()} "
        f"+ optimizer {_gib(mem['optimizer_bytes']).strip()} (fp32 master + Adam moments, ZeRO stage "
        f"{lay['zero_stage']}) + DeepSpeed buffers {_gib(mem['persistent_buffers_bytes']).strip()}"
        + (f" + pipeline buffers {_gib(mem['pipe_buffers_bytes']).strip()}" if mem["pipe_buffers_bytes"] else ""),
        f"  activations kept for backward ({ckpt}): {_gib(mem['activations_bytes'][ckpt]).strip()}; loss transient "
        f"{_gib(mem['loss_forward_transient_bytes']).strip()}; gradients and reduction buffers at the end of "
        f"backward {_gib(mem['end_of_backward_bytes']).strip()}; optimizer step {_gib(mem['step_bytes']).strip()}",
    ]
    for label, key in (("ZeRO 3 gathered weights", "gathered_weights_bytes"),
                       ("earlier micro-batches' gradients", "accumulated_gradients_bytes"),
                       ("ZeRO reduce bucket through the backward", "backward_buffers_bytes")):
        if mem[key]:
            lines.append(f"  {label}: {_gib(mem[key]).strip()}")
    phases = mem["phases_bytes"][ckpt]
    lines.append("  by phase: " + ", ".join(
        f"{phase} {_gib(phases[phase]).strip()}{' <- peak' if phase == mem['peak_phase'] else ''}" for phase in PHASES))
    for mode in CHECKPOINTING_MODES:
        marker = "  <- configured" if mode == ckpt else ""
        lines.append(f"  checkpointing {mode:<9} activations {_gib(mem['activations_bytes'][mode])}  "
                     f"peak {_gib(mem['total_bytes_by_checkpointing'][mode])}{marker}{_mode_note(mode, mem)}")
    gpu = mem["gpu_allowances"]
    lines += [
        f"  total:        {_gib(mem['total_bytes'])} of tensors (what torch.cuda.max_memory_allocated measures)",
        f"  on a GPU, about {_gib(gpu['device_total_bytes']).strip()} in all with these allowances (assumed, not "
        f"yet measured): CUDA context {_gib(gpu['cuda_context_bytes']).strip()}, NCCL "
        f"{_gib(gpu['nccl_bytes']).strip()}, cuBLAS and flash-attention workspaces "
        f"{_gib(gpu['workspaces_bytes']).strip()}, allocator slack {gpu['allocator_fraction']:.0%} of the tensors",
        f"  host memory for checkpoint snapshots: {_gib(mem['checkpoint_snapshot_host_bytes']).strip()} per rank, "
        f"kept from the first save on (checkpoint.async_save {mem['checkpoint_async_save']}; pinned with CUDA); "
        "times the ranks of one machine, it must fit that machine's memory",
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
