"""Memory per rank for a config's parallel layout: weights, gradients, optimizer state, activations.

All numbers are bytes on one rank of the heaviest pipeline stage; CUDA context, allocator
fragmentation, communication buffers and temporary tensors are not included (keep a margin).

Model states, per parameter held by the rank (ψ):
  * bf16/fp16: weights 2 bytes; gradients 2 (4 with bf16 and ``precision.fp32_grad_accum``);
    optimizer 12 (fp32 master copy 4 + Adam moments 4 + 4).  fp32: 4 + 4 + 8.
  * ZeRO over the data-parallel group (size d): stage ≥1 divides the optimizer state by d, stage ≥2
    the gradients, stage 3 the weights.
  * ψ per rank: matrices divided by the tensor-parallel size t, norm gains replicated; the stage's
    layers (``pipeline_boundaries`` or an even split); the vocabulary-parallel embedding (padded
    vocabulary / t) on the first stage, the head on the last (with tied embeddings and p > 1 the last
    stage holds a copy of the embedding).

Activations, 16-bit, per layer and micro-batch (s sequence, b micro-batch, h hidden, f FFN,
h_kv = kv heads × head dim, a heads), following Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") adapted to the LLaMA block:
  * R (replicated over the tensor group unless sequence parallel) = 4sbh (two norm inputs)
    + 2sbh (QKV input) + 2sbh (MLP input) + 2sbh (two dropout masks, only with hidden dropout > 0);
  * S (split over the tensor group) = 2sb(h + 2h_kv) (Q, K, V) + 2sbh (output-projection input)
    + 8sbf (SwiGLU: gate and up 4sbf, SiLU output 2sbf, product 2sbf) + C;
  * C (attention core) = 4·a·s·b with SDPA / flash attention (fp32 log-sum-exp; the s×s scores are
    never stored), or Korthikanti's 5·a·s²·b when the scores are materialised.
  Per layer: R/t + S/t with sequence parallelism, R + S/t without. For reference, Korthikanti's GPT
  block (4h GeLU MLP, dropout, scores stored) is s·b·h·(34 + 5·a·s/h).
  Recomputation: ``selective`` drops C; ``full`` keeps only each layer's input, 2sbh (/t with
  sequence parallelism), plus one layer's full activations while it is recomputed.
  A 1F1B pipeline keeps min(p - stage, accumulation steps) micro-batches in flight on a stage; the
  last stage adds the logits and the loss, 4·s·b·V/t (Korthikanti's output-layer term).
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

    def total(self, checkpointing: str) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations[checkpointing]


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
                           scores_stored: bool = False) -> float:
    """Activation bytes one layer keeps for backward, per micro-batch (formula in the module docstring)."""
    s, b, h, f, a = seq_len, micro_batch, model.hidden_size, model.ffn_hidden_size, model.num_heads
    h_kv = model.kv_heads * model.head_dim
    if checkpointing == "full":
        return 2 * s * b * h / (tensor if sequence_parallel else 1)
    replicated = 8 * s * b * h + (2 * s * b * h if model.hidden_dropout > 0 else 0)
    core = 5 * a * s * s * b if scores_stored else 4 * a * s * b
    split = 2 * s * b * (h + 2 * h_kv) + 2 * s * b * h + 8 * s * b * f
    if checkpointing == "none":
        split += core
    return (replicated / tensor if sequence_parallel else replicated) + split / tensor


def korthikanti_gpt_layer_bytes(model: ModelConfig, seq_len: int, micro_batch: int) -> float:
    """The paper's GPT-block reference: s·b·h·(34 + 5·a·s/h) bytes, no parallelism, no recompute."""
    s, b, h, a = seq_len, micro_batch, model.hidden_size, model.num_heads
    return s * b * h * (34 + 5 * a * s / h)


def _bytes_per_parameter(config: Config) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter before ZeRO sharding."""
    precision = config.precision
    if precision.dtype == "fp32":
        return 4, 4, 8
    gradients = 4 if precision.dtype == "bf16" and precision.fp32_grad_accum else 2
    return 2, gradients, 12


def memory_estimate(config: Config, world_size: int) -> MemoryEstimate:
    """Per-rank memory of ``config`` on ``world_size`` ranks (layout from ``config.parallel``)."""
    model, par = config.model, config.parallel
    tp, pp = par.tensor, par.pipeline
    dp = max(config.data_parallel_size(world_size), 1)
    accumulation = max(config.grad_accumulation_steps(world_size), 1)
    weight_b, grad_b, optim_b = _bytes_per_parameter(config)
    zero = par.zero_stage
    s, b = config.data.seq_len, config.train.micro_batch_size
    stages = []
    for stage, layers in enumerate(stage_layer_counts(model.num_layers, pp, par.pipeline_boundaries)):
        params = stage_parameters(model, tp, pp, stage, layers)
        in_flight = min(pp - stage, accumulation) if pp > 1 else 1
        activations = {}
        for mode in CHECKPOINTING_MODES:
            per_layer = layer_activation_bytes(model, s, b, tp, par.sequence_parallel, mode)
            total = layers * per_layer * in_flight
            if mode == "full":  # one layer's activations exist while it is recomputed for backward
                total += layer_activation_bytes(model, s, b, tp, par.sequence_parallel, "none")
            if stage == pp - 1:
                total += 4 * s * b * model.padded_vocab_size(tp) / tp
            activations[mode] = total
        stages.append(StageMemory(
            stage=stage, layers=layers, parameters=params,
            weights=params * weight_b / (dp if zero >= 3 else 1),
            gradients=params * grad_b / (dp if zero >= 2 else 1),
            optimizer=params * optim_b / (dp if zero >= 1 else 1),
            activations=activations))
    return MemoryEstimate(checkpointing=config.train.activation_checkpointing, stages=stages,
                          tensor=tp, pipeline=pp, data=dp, zero_stage=zero)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"
