"""Memory per rank for a config's parallel layout: weights, gradients, optimizer state, activations.

All numbers are bytes on one rank of the heaviest pipeline stage; CUDA context, allocator
fragmentation, communication buffers and temporary tensors are not included (keep a margin).

Model states, per parameter held by the rank (ψ):
  * bf16/fp16: weights 2 bytes; gradients 2, or 4 where DeepSpeed accumulates bf16 gradients in fp32
    (``precision.fp32_grad_accum`` with ZeRO ≥ 1 or a pipeline; see ``config.deepspeed_json``);
    optimizer 12 (fp32 master copy 4 + Adam moments 4 + 4).  fp32: 4 + 4 + 8.
  * ZeRO over the data-parallel group (size d): stage ≥1 divides the optimizer state by d, stage ≥2
    the gradients, stage 3 the weights.
  * ψ per rank: matrices divided by the tensor-parallel size t, norm gains replicated; the stage's
    layers (``pipeline_boundaries`` or an even split); the vocabulary-parallel embedding (padded
    vocabulary / t) on the first stage, the head on the last (with tied embeddings and p > 1 the last
    stage holds a copy of the embedding).

Activations, per layer and micro-batch (s sequence, b micro-batch, h hidden, f FFN, h_kv = kv heads ×
head dim, a heads, e bytes per activation element: 2 in bf16/fp16, 4 in fp32), following Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") adapted to the LLaMA
block as lnstrain computes it (``lnstrain.model.kernels``: RMSNorm keeps its input and a per-row
fp32 statistic, SwiGLU recomputes silu in backward):
  * R (replicated over the tensor group unless sequence parallel) = 2e·sbh (two norm inputs)
    + e·sbh (QKV input) + e·sbh (MLP input) + 2sbh (two 1-byte dropout masks, only with hidden dropout > 0);
  * S (split over the tensor group) = e·sb(h + 2h_kv) (rotated Q, K and V) + e·sbh (attention output,
    the output projection's input) + 3e·sbf (SwiGLU: gate, up, and their product, the down projection's
    input) + C;
  * C (attention core) = 4·a·s·b with SDPA / flash attention (fp32 log-sum-exp; the s×s scores are
    never stored), or Korthikanti's 5·a·s²·b when the scores are materialised.
  Per layer: R/t + S/t with sequence parallelism, R + S/t without. For reference, Korthikanti's GPT
  block (4h GeLU MLP, dropout, scores stored) is s·b·h·(34 + 5·a·s/h).
  Recomputation: ``selective`` drops C; ``full`` keeps only each layer's input, e·sbh (/t with
  sequence parallelism), plus one layer's full activations while it is recomputed.
  A 1F1B pipeline keeps min(p - stage, accumulation steps) micro-batches in flight on a stage; the
  last stage adds the loss: the logits and their fp32 log-probabilities, (e + 4)·s·b·V/t.
Peak = weights + optimizer state + DeepSpeed's persistent buffers + the larger of (gradients +
activations), counted at their fullest although backward frees activations as gradients appear, and
the gradients held at the end of backward and in the step, which depend on the optimizer DeepSpeed
wraps ours in (``deepspeed_optimizer``: its fp32 copies and all-reduce buckets). ZeRO 3's buffers
are not modelled. ``docs/performance.md`` has the measured ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lnstrain.config.run_config import Config
from lnstrain.model.config import ModelConfig, NormScheme
from lnstrain.model.norm_schemes import has_final_norm, norms_per_block

GIB = 1024**3
CHECKPOINTING_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of one pipeline stage."""

    stage: int
    layers: int
    parameters: int
    weights: float
    gradients: float
    optimizer: float
    activations: dict[str, float] = field(default_factory=dict)
    """Activation bytes by checkpointing mode (``none``, ``selective``, ``full``)."""
    step_gradients: float = 0.0
    """Gradient bytes at the end of backward and in the optimizer step, when more than ``gradients``
    (DeepSpeed's fp32 copies and all-reduce buckets)."""
    buffers: float = 0.0
    """DeepSpeed's persistent communication buffers (the ZeRO 1/2 reduce bucket)."""

    def total(self, checkpointing: str) -> float:
        during_step = max(self.step_gradients, self.gradients)
        return (self.weights + self.optimizer + self.buffers
                + max(self.gradients + self.activations[checkpointing], during_step))


@dataclass(frozen=True)
class MemoryEstimate:
    """The heaviest stage's memory for the configured layout, plus every stage for reference."""

    checkpointing: str
    stages: list[StageMemory]
    tensor: int
    pipeline: int
    data: int
    zero_stage: int

    @property
    def heaviest(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total(self.checkpointing))

    @property
    def total(self) -> float:
        return self.heaviest.total(self.checkpointing)

    def total_with(self, checkpointing: str) -> float:
        return max(st.total(checkpointing) for st in self.stages)


def stage_layer_counts(num_layers: int, pipeline: int, boundaries: list[int] | None = None) -> list[int]:
    """Transformer layers per stage: the explicit boundaries, else an even split (extra layers first)."""
    if boundaries:
        return list(boundaries)
    base, extra = divmod(num_layers, pipeline)
    return [base + (1 if stage < extra else 0) for stage in range(pipeline)]


def layer_parameters_per_rank(model: ModelConfig, tensor: int) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    norm_size = model.hidden_size * (2 if model.norm_type == "layernorm" else 1)
    final_norm = norm_size if has_final_norm(model.norm_scheme) else 0
    per_layer = (model.num_parameters(include_embeddings=False) - final_norm) // model.num_layers
    replicated = norms_per_block(model.norm_scheme) * norm_size
    if model.norm_scheme == NormScheme.LAYERSCALE:
        replicated += 2 * model.hidden_size
    return (per_layer - replicated) // tensor + replicated


def stage_parameters(model: ModelConfig, tensor: int, pipeline: int, stage: int, layers: int) -> int:
    """Parameters held by one rank of ``stage``."""
    embedding = model.padded_vocab_size(tensor) * model.hidden_size // tensor
    norm_size = model.hidden_size * (2 if model.norm_type == "layernorm" else 1)
    count = layers * layer_parameters_per_rank(model, tensor)
    if stage == 0:
        count += embedding
    if stage == pipeline - 1:
        count += norm_size if has_final_norm(model.norm_scheme) else 0
        if not model.tie_embeddings or pipeline > 1:
            count += embedding
    return count


def layer_activation_bytes(model: ModelConfig, seq_len: int, micro_batch: int, tensor: int,
                           sequence_parallel: bool, checkpointing: str,
                           scores_stored: bool = False, element_bytes: int = 2) -> float:
    """Activation bytes one layer keeps for backward, per micro-batch (formula in the module docstring)."""
    s, b, h, f, a = seq_len, micro_batch, model.hidden_size, model.ffn_hidden_size, model.num_heads
    h_kv, e = model.kv_heads * model.head_dim, element_bytes
    if checkpointing == "full":
        return e * s * b * h / (tensor if sequence_parallel else 1)
    replicated = 4 * e * s * b * h + (2 * s * b * h if model.hidden_dropout > 0 else 0)
    core = 5 * a * s * s * b if scores_stored else 4 * a * s * b
    split = e * s * b * (h + 2 * h_kv) + e * s * b * h + 3 * e * s * b * f
    if checkpointing == "none":
        split += core
    return (replicated / tensor if sequence_parallel else replicated) + split / tensor


def korthikanti_gpt_layer_bytes(model: ModelConfig, seq_len: int, micro_batch: int) -> float:
    """The paper's GPT-block reference: s·b·h·(34 + 5·a·s/h) bytes, no parallelism, no recompute."""
    s, b, h, a = seq_len, micro_batch, model.hidden_size, model.num_heads
    return s * b * h * (34 + 5 * a * s / h)


def element_bytes(config: Config) -> int:
    """Bytes of one weight, gradient or activation element in the training precision."""
    return 4 if config.precision.dtype == "fp32" else 2


def _bytes_per_parameter(config: Config) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter before ZeRO sharding. DeepSpeed's ZeRO
    optimizers keep an fp32 master partition even of fp32 weights (12 optimizer bytes then too)."""
    precision, parallel = config.precision, config.parallel
    if precision.dtype == "fp32":
        return 4, 4, 8 if parallel.zero_stage == 0 else 12
    fp32_accumulation = precision.dtype == "bf16" and precision.fp32_grad_accum and (
        parallel.zero_stage >= 1 or parallel.pipeline > 1)
    return 2, 4 if fp32_accumulation else 2, 12


def _gradient_bytes(config: Config, params: float, dp: int) -> float:
    """Gradient bytes held during backward. ZeRO 1 without BF16_Optimizer keeps each parameter's full
    16-bit (or fp32) ``.grad`` and an fp32 partition of them; ZeRO 2 only the partition."""
    _, grad_b, _ = _bytes_per_parameter(config)
    zero = config.parallel.zero_stage
    if zero == 1 and deepspeed_optimizer(config) == "zero":
        return params * element_bytes(config) + params * 4 / dp
    return params * grad_b / (dp if zero >= 2 else 1)


DEEPSPEED_DEFAULT_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's ``zero_optimization.reduce_bucket_size`` default (elements)."""
DEEPSPEED_ALLREDUCE_BUCKET = 500_000_000
"""Elements per bucket of DeepSpeed's engine-level all-reduce (BF16_Optimizer's data parallelism)."""


def deepspeed_optimizer(config: Config) -> str:
    """Which DeepSpeed optimizer wraps ours (DeepSpeed 0.19, measured in tests/training/test_engine_precision.py):
    ``fp16_unfused`` (16-bit, ZeRO 0, no pipeline), ``bf16_optimizer`` (bf16 with fp32 accumulation at
    ZeRO 1, or any bf16 pipeline at ZeRO 0), ``zero`` (ZeRO 1/2 otherwise), ``zero3``, or ``none`` (fp32 ZeRO 0)."""
    precision, parallel = config.precision, config.parallel
    if parallel.zero_stage == 3:
        return "zero3"
    if precision.dtype == "bf16" and ((parallel.zero_stage == 1 and precision.fp32_grad_accum)
                                      or (parallel.zero_stage == 0 and parallel.pipeline > 1)):
        return "bf16_optimizer"
    if parallel.zero_stage > 0:
        return "zero"
    return "none" if precision.dtype == "fp32" else "fp16_unfused"


def _reduce_bucket(config: Config, world_size: int) -> tuple[int, bool]:
    """(``reduce_bucket_size``, ``overlap_comm``) from the DeepSpeed JSON lnstrain derives."""
    from lnstrain.config.deepspeed_json import deepspeed_config

    zero = deepspeed_config(config, world_size)["zero_optimization"]
    return int(zero.get("reduce_bucket_size", DEEPSPEED_DEFAULT_REDUCE_BUCKET)), bool(zero.get("overlap_comm", False))


def _deepspeed_gradient_memory(config: Config, world_size: int, params: float,
                               gradients: float) -> tuple[float, float]:
    """(gradient bytes held at the end of backward and in the step, 0 when no more than ``gradients``;
    persistent buffer bytes), as measured on CPU engines (docs/performance.md):

    * ``fp16_unfused``: the step converts every 16-bit gradient to an fp32 copy (+4 bytes per parameter);
    * ``bf16_optimizer``: the bf16 ``.grad`` (2 bytes) beside the fp32 accumulation buffer, and the
      engine's all-reduce flattens up to ``DEEPSPEED_ALLREDUCE_BUCKET`` of them and sends an fp32 copy (6);
    * ``zero``: a reduce bucket of ``reduce_bucket_size`` gradient elements, kept for the whole run
      (two with ``overlap_comm``).
    """
    kind = deepspeed_optimizer(config)
    if kind == "fp16_unfused":
        return gradients + 4 * params, 0.0
    if kind == "bf16_optimizer":
        return gradients + 2 * params + 6 * min(DEEPSPEED_ALLREDUCE_BUCKET, params), 0.0
    if kind == "zero":
        bucket, overlap = _reduce_bucket(config, world_size)
        return 0.0, bucket * element_bytes(config) * (2 if overlap else 1)
    return 0.0, 0.0


def memory_estimate(config: Config, world_size: int) -> MemoryEstimate:
    """Per-rank memory of ``config`` on ``world_size`` ranks (layout from ``config.parallel``)."""
    model, par = config.model, config.parallel
    tp, pp = par.tensor, par.pipeline
    dp = max(config.data_parallel_size(world_size), 1)
    accumulation = max(config.grad_accumulation_steps(world_size), 1)
    weight_b, _, optim_b = _bytes_per_parameter(config)
    zero = par.zero_stage
    s, b = config.data.seq_len, config.train.micro_batch_size
    e = element_bytes(config)
    stages = []
    for stage, layers in enumerate(stage_layer_counts(model.num_layers, pp, par.pipeline_boundaries)):
        params = stage_parameters(model, tp, pp, stage, layers)
        in_flight = min(pp - stage, accumulation) if pp > 1 else 1
        activations = {}
        for mode in CHECKPOINTING_MODES:
            per_layer = layer_activation_bytes(model, s, b, tp, par.sequence_parallel, mode, element_bytes=e)
            total = layers * per_layer * in_flight
            if mode == "full":  # one layer's activations exist while it is recomputed for backward
                total += layer_activation_bytes(model, s, b, tp, par.sequence_parallel, "none", element_bytes=e)
            if stage == pp - 1:
                total += (e + 4) * s * b * model.padded_vocab_size(tp) / tp
            activations[mode] = total
        gradients = _gradient_bytes(config, params, dp)
        step_gradients, buffers = _deepspeed_gradient_memory(config, world_size, params, gradients)
        stages.append(StageMemory(
            stage=stage, layers=layers, parameters=params,
            weights=params * weight_b / (dp if zero >= 3 else 1),
            gradients=gradients,
            optimizer=params * optim_b / (dp if zero >= 1 else 1),
            activations=activations,
            step_gradients=step_gradients, buffers=buffers))
    return MemoryEstimate(checkpointing=config.train.activation_checkpointing, stages=stages,
                          tensor=tp, pipeline=pp, data=dp, zero_stage=zero)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def unmodelled_buffers_note(config: Config, world_size: int, estimate: MemoryEstimate) -> str:
    """What the estimate leaves out for this config (empty when nothing known): ZeRO 3's buffers."""
    if config.parallel.zero_stage != 3:
        return ""
    bucket, _ = _reduce_bucket(config, world_size)
    return (f"ZeRO 3: DeepSpeed's reduce bucket (reduce_bucket_size {bucket:,} elements, about "
            f"{gib(bucket * element_bytes(config))}) "
            "and its prefetch and persistence buffers are not counted in the estimate; set deepspeed: "
            "{zero_optimization: {reduce_bucket_size: N, stage3_prefetch_bucket_size: N}} to cap them")
