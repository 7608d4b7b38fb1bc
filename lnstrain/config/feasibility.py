"""Whether a config can run, and how DeepSpeed will wrap lnstrain's optimizer when it does.

Each section's dataclass checks its own values (``validate``). The rules here need several sections
or the world size: the layout against the model and the world, the batch against the data-parallel
size, and precision × ZeRO × pipeline, where what goes wrong depends on the optimizer DeepSpeed 0.19
wraps ours in (``optimizer_kind``). ``Config.validate`` applies them, so a launch's one list of
problems (``lnstrain.training.preflight``) names each once; ``check_layout`` refuses a config before
any process group for callers that build an engine without that list (benchmarks, tools, tests).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

from lnstrain.config.loader import ConfigError
from lnstrain.parallel.config import world_size_problems
from lnstrain.parallel.float8 import ALIGNMENT

if TYPE_CHECKING:
    from lnstrain.data.config import DataConfig
    from lnstrain.model.config import ModelConfig
    from lnstrain.parallel.config import ParallelConfig
    from lnstrain.training.config import OptimConfig, PrecisionConfig, TrainConfig


class RunSections(Protocol):
    """What the rules read of a run's config: ``lnstrain.config.run_config.Config``, whose ``validate``
    applies them (so this module names its sections, not the class)."""

    model: ModelConfig
    parallel: ParallelConfig
    optim: OptimConfig
    train: TrainConfig
    precision: PrecisionConfig
    data: DataConfig

    def data_parallel_size(self, world_size: int) -> int: ...

    def shard_replicas(self, world_size: int) -> int: ...

    def grad_accumulation_steps(self, world_size: int) -> int: ...


class OptimizerKind(enum.StrEnum):
    """The optimizer DeepSpeed 0.19 wraps ours in: the memory each keeps was measured with
    ``lnstrain.benchmark.phase_memory``, the class at bf16 ZeRO 0-2 in tests/training/test_engine_precision.py,
    and ``build_engine`` refuses to go on if fp32 at ZeRO 0 comes back wrapped."""

    NONE = "none"
    """fp32 at ZeRO 0: lnstrain's torch optimizer, unwrapped."""
    FP16_UNFUSED = "fp16_unfused"
    """``FP16_UnfusedOptimizer``: 16-bit at ZeRO 0 where BF16_Optimizer is not chosen; fp32 master weights,
    micro-batch gradients added up in the 16-bit ``.grad``."""
    BF16_OPTIMIZER = "bf16_optimizer"
    """``BF16_Optimizer``: bf16 at ZeRO 1 asking for fp32 accumulation, or any bf16 pipeline at ZeRO 0;
    micro-batch gradients added up in fp32 buffers."""
    ZERO = "zero"
    """``DeepSpeedZeroOptimizer``: ZeRO 1 and 2 otherwise."""
    ZERO3 = "zero3"
    """``DeepSpeedZeroOptimizer_Stage3``."""

    @property
    def lnstrain_clips(self) -> bool:
        """Whether lnstrain clips the gradients itself (``GradClipHook``, with DeepSpeed's clipping off):
        only unwrapped, where DeepSpeed's ``clip_grad_norm_`` counts replicated parameters on the first
        pipeline stage only and reports no norm."""
        return self is OptimizerKind.NONE


def asks_fp32_accumulation(config: RunSections) -> bool:
    """Whether the DeepSpeed JSON asks for ``data_types.grad_accum_dtype: fp32``: bf16 with
    ``precision.fp32_grad_accum`` under ZeRO 1-3. At ZeRO 0 DeepSpeed refuses the key ("unsupported mix
    of model_dtype=bf16 and grad_accum_dtype=fp32"); there a pipeline's BF16_Optimizer accumulates in
    fp32 anyway and ``bf16_accumulation_problem`` refuses the rest."""
    precision = config.precision
    return precision.dtype == "bf16" and precision.fp32_grad_accum and config.parallel.zero_stage > 0


def optimizer_kind(config: RunSections) -> OptimizerKind:
    """The optimizer DeepSpeed will wrap ours in for ``config``."""
    precision, parallel = config.precision, config.parallel
    if parallel.zero_stage == 3:
        return OptimizerKind.ZERO3
    if precision.dtype == "bf16" and ((parallel.zero_stage == 1 and asks_fp32_accumulation(config))
                                      or (parallel.zero_stage == 0 and parallel.pipeline > 1)):
        return OptimizerKind.BF16_OPTIMIZER
    if parallel.zero_stage > 0:
        return OptimizerKind.ZERO
    return OptimizerKind.NONE if precision.dtype == "fp32" else OptimizerKind.FP16_UNFUSED


ZERO3_COMPILE_REFUSAL = (
    "train.compile: true with parallel.zero_stage 3: ZeRO-3 gathers each layer's parameters in module hooks "
    "that torch.compile cannot trace, so a compiled layer falls apart into fragments (a 6-layer model gave 13 "
    "graphs and 36 graph breaks where ZeRO 0-2 give 2 graphs and none) and runs no faster than eager. Use "
    "parallel.zero_stage 1 or 2 with compilation, or train.compile: false (or auto, which leaves ZeRO-3 eager).")


def compiles_layers(config: RunSections, device_type: str) -> bool:
    """Whether ``build_model`` compiles the transformer layers on ``device_type`` (``cuda`` or ``cpu``):
    ``train.compile`` true, or ``auto`` on CUDA; never at ZeRO 3 (``compile_problem`` refuses true there).
    Context parallelism compiles like any layout: the attention across the split is one opaque operator
    in the graph (``parallel.ring_attention``) or functional all-to-alls dynamo traces."""
    setting = config.train.compile
    if config.parallel.zero_stage == 3:
        return False
    return setting is True or (setting == "auto" and device_type == "cuda")


def compile_problem(config: RunSections) -> str:
    """Why ``train.compile`` cannot be true with this layout; empty when it can."""
    if config.train.compile is True and config.parallel.zero_stage == 3:
        return ZERO3_COMPILE_REFUSAL
    return ""


def _context_problems(config: RunSections) -> list[str]:
    """Context parallelism against the sequence, the heads and what it does not support."""
    model, par, seq_len = config.model, config.parallel, config.data.seq_len
    context = par.context
    if context <= 1 or par.tensor < 1:
        return []
    problems = []
    if seq_len % (2 * context):
        problems.append(f"data.seq_len ({seq_len}) must be divisible by 2 × parallel.context ({2 * context}): each "
                        f"context rank holds two of 2 × {context} equal chunks")
    elif par.sequence_parallel and par.tensor > 1 and (seq_len // context) % par.tensor:
        problems.append(f"data.seq_len / parallel.context ({seq_len // context}) must be divisible by parallel.tensor "
                        f"({par.tensor}) with sequence parallelism")
    if par.context_method == "all_to_all" and model.num_heads % par.tensor == 0:
        heads, kv_heads = model.num_heads // par.tensor, max(model.kv_heads // par.tensor, 1)
        if heads % context or kv_heads % context:
            problems.append(f"parallel.context_method all_to_all needs the query heads ({heads}) and key/value heads "
                            f"({kv_heads}) of each tensor rank divisible by parallel.context ({context}); use "
                            "parallel.context_method: ring")
    if model.attention_dropout > 0:
        problems.append(f"model.attention_dropout ({model.attention_dropout}) must be 0 with parallel.context > 1: "
                        "attention across the context split has no dropout")
    return problems + [problem for problem in [_context_fp8_problem(config)] if problem]


def _context_fp8_problem(config: RunSections) -> str:
    """Float8 products need every dimension a multiple of ``float8.ALIGNMENT`` (else they stay 16-bit): a
    context rank's linear layers see micro-batch × sequence / N tokens, one process's all of them, so
    where only the whole is aligned the ranks would compute in bf16 what one process computes in float8."""
    mode, context = config.precision.fp8, config.parallel.context
    tokens = config.train.micro_batch_size * config.data.seq_len
    if mode == "none" or tokens % ALIGNMENT or tokens % (2 * context) or (tokens // context) % ALIGNMENT == 0:
        return ""
    return (f"precision.fp8 {mode} with parallel.context {context}: each context rank's linear layers see "
            f"train.micro_batch_size × data.seq_len / {context} = {tokens // context} tokens, not a multiple of "
            f"{ALIGNMENT}, so they would compute in bf16 what one process computes in float8; make "
            f"micro_batch_size × seq_len ({tokens}) divisible by {ALIGNMENT * context}")


def _shape_problems(config: RunSections) -> list[str]:
    """The layout against the model's depth and the sequence length."""
    problems = []
    model, par, seq_len = config.model, config.parallel, config.data.seq_len
    if par.pipeline >= 1 and model.num_layers < par.pipeline:
        problems.append(f"model.num_layers ({model.num_layers}) is smaller than parallel.pipeline "
                        f"({par.pipeline}); every stage needs at least one layer")
    if par.pipeline_boundaries is not None and sum(par.pipeline_boundaries) != model.num_layers:
        problems.append(f"parallel.pipeline_boundaries sum to {sum(par.pipeline_boundaries)} "
                        f"but model.num_layers is {model.num_layers}")
    if par.sequence_parallel and par.tensor > 1 and seq_len % par.tensor:
        problems.append(f"data.seq_len ({seq_len}) must be divisible by parallel.tensor "
                        f"({par.tensor}) with sequence parallelism")
    if seq_len > model.max_seq_len:
        problems.append(f"data.seq_len ({seq_len}) exceeds model.max_seq_len ({model.max_seq_len})")
    return problems + _context_problems(config)


def _batch_problems(config: RunSections, world_size: int) -> list[str]:
    """The global batch must split into whole micro-batches over the data-parallel ranks."""
    train, par = config.train, config.parallel
    if min(par.tensor, par.pipeline, par.context, train.micro_batch_size) < 1 or world_size_problems(
            world_size, par.tensor, par.pipeline, par.context):
        return []  # problems reported on their own
    dp = config.data_parallel_size(world_size)
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step == 0:
        return []
    return [f"train.global_batch_size ({train.global_batch_size}) must be divisible by train.micro_batch_size × "
            f"data-parallel size ({train.micro_batch_size} × {dp} = {per_step}); try train.global_batch_size: "
            f"{max(per_step, round(train.global_batch_size / per_step) * per_step)}"]


def bf16_accumulation_problem(config: RunSections, world_size: int) -> str:
    """Why DeepSpeed cannot give this config the fp32 gradient accumulation it asks for; empty when it can."""
    precision, parallel = config.precision, config.parallel
    if not (precision.dtype == "bf16" and precision.fp32_grad_accum
            and optimizer_kind(config) is OptimizerKind.FP16_UNFUSED):
        return ""
    if (min(parallel.tensor, parallel.pipeline, parallel.context) < 1 or config.data_parallel_size(world_size) < 1
            or config.train.micro_batch_size < 1):
        return ""  # a layout problem reported on its own
    steps = config.grad_accumulation_steps(world_size)
    if steps <= 1:
        return ""
    return (f"precision.dtype bf16 with precision.fp32_grad_accum and parallel.zero_stage 0 accumulates {steps} "
            "micro-batches per step, but DeepSpeed accumulates bf16 gradients in fp32 only under ZeRO (or a "
            "pipeline). Set parallel.zero_stage: 1 (the same update, optimizer state split over data-parallel "
            "ranks), or precision.fp32_grad_accum: false to accumulate in bf16, or one micro-batch per step "
            "(train.micro_batch_size = train.global_batch_size / data-parallel size).")


def fp16_loss_scaling_problem(config: RunSections) -> str:
    """fp16 at ZeRO 0: DeepSpeed 0.19's engine scales the loss in backward only for ZeRO optimizers, while
    its FP16_Optimizer / FP16_UnfusedOptimizer still divide the gradients by the loss scale, so every
    update would be 1/scale of its size (upstream: deepspeedai/DeepSpeed PR 8393). Empty when fine."""
    if config.precision.dtype != "fp16" or optimizer_kind(config) is not OptimizerKind.FP16_UNFUSED:
        return ""
    return ("precision.dtype fp16 with parallel.zero_stage 0: DeepSpeed 0.19 does not scale the fp16 loss "
            "without ZeRO but still unscales the gradients, which would shrink every update by the loss "
            "scale. Set parallel.zero_stage: 1 (or higher), or precision.dtype: bf16.")


def overcounted_kv_rows(config: RunSections) -> str:
    """Why the clipping norm would overcount replicated key/value rows; empty when it would not.

    A refused problem where DeepSpeed clips; where lnstrain clips itself, a warning the engine logs."""
    parallel, model = config.parallel, config.model
    if not (parallel.tensor > 1 and model.fused_qkv and model.kv_heads < parallel.tensor
            and config.optim.grad_clip > 0):
        return ""
    if model.num_heads % parallel.tensor:  # the heads cannot be split at all: that problem is reported alone
        return ""
    return (f"model.fused_qkv with model.num_kv_heads ({model.kv_heads}) < parallel.tensor ({parallel.tensor}) "
            "puts sharded query rows and replicated key/value rows in one parameter; a gradient norm counts "
            "a parameter on every tensor rank or on one, so the key/value rows are counted "
            f"{parallel.tensor // model.kv_heads} times in the clipping norm.")


def _precision_problems(config: RunSections, world_size: int | None) -> list[str]:
    """Precision × ZeRO × pipeline × clipping: what DeepSpeed's optimizer for this config would get wrong."""
    problems = [bf16_accumulation_problem(config, world_size) if world_size is not None else "",
                fp16_loss_scaling_problem(config), compile_problem(config)]
    overcount = overcounted_kv_rows(config)
    if overcount and not optimizer_kind(config).lnstrain_clips:
        problems.append(overcount + " Set model.fused_qkv: false (separate projections are counted exactly) "
                        "or optim.grad_clip: 0")
    return [problem for problem in problems if problem]


def cross_section_problems(config: RunSections, world_size: int | None) -> list[str]:
    """Every rule between sections; those that need the world size only when it is given."""
    problems = _shape_problems(config)
    if world_size is not None:
        problems += world_size_problems(world_size, config.parallel.tensor, config.parallel.pipeline,
                                        config.parallel.context)
        problems += _batch_problems(config, world_size)
    return problems + _precision_problems(config, world_size)


def layout_problems(config: RunSections, world_size: int) -> list[str]:
    """Everything that would make the engine fail or hang: the sections it reads and every cross-section rule.

    The data, run, checkpoint and logging sections are not checked here (the engine never reads them);
    ``Config.validate`` checks them too.
    """
    problems = config.model.validate(tensor_parallel=max(config.parallel.tensor, 1))
    for section in (config.parallel, config.optim, config.train, config.precision):
        problems += section.validate()
    return problems + cross_section_problems(config, world_size)


def check_layout(config: RunSections, world_size: int) -> None:
    """Raise ``ConfigError`` listing every layout problem (call before building process groups)."""
    problems = layout_problems(config, world_size)
    if problems:
        raise ConfigError(problems, "parallel layout")
