"""Memory per rank of a config's parallel layout, phase by phase: what a training step really holds.

All numbers are bytes of live tensors on one rank of the heaviest pipeline stage (what
``torch.cuda.max_memory_allocated`` measures); ``gpu_allowances`` adds what a GPU holds besides
tensors. The peak is the largest of three phases of a steady step (not the first, whose optimizer
state does not exist yet), never a sum of terms that do not coexist:

    held     = weights + optimizer state (+ DeepSpeed's persistent buffers)     between steps
    forward  = held + activations kept for backward + the loss's transient      (end of the forward)
    backward = held + max(activations + the head's first gradients,             (start of backward)
                          gradients + DeepSpeed's reduction buffers)            (end of backward)
    step     = held + what the optimizer step adds (gradients, fp32 copies)

Model states, per parameter ψ held by the rank (matrices / tensor size t, norm gains replicated, the
stage's layers, the vocabulary-parallel embedding on the first stage and the head on the last):
weights 2 bytes in bf16/fp16, 4 in fp32 (ZeRO 3 divides them by the data-parallel size d); Adam's
moments 8 and, except for fp32 without ZeRO, an fp32 master copy 4, divided by d under ZeRO. The
rest depends on the optimizer DeepSpeed 0.19 wraps ours in (``lnstrain.config.feasibility.optimizer_kind``);
each row was measured term by term on CPU engines (``lnstrain.benchmark.phase_memory``, docs/performance.md),
E = min(ψ, 500M) the engine's all-reduce bucket, R the ZeRO reduce bucket, m the largest tensor:

    kind            persistent         end of backward                        step
    none            -                  4ψ + 4E (.grad, flattened copy)        4ψ + 4m (clipping)
    fp16_unfused    -                  2ψ + 2E                                2ψ + 4ψ (fp32 copies)
    bf16_optimizer  4ψ (fp32 accum.)   2ψ + 6E (+ fp32 copy sent)             2ψ
                    (its bf16 gradients, kept and zeroed between micro-batches, also live through the
                    later micro-batches' forwards: 2ψ there)
    (bf16 gradients added to the fp32 buffer in backward, lnstrain's default at pipeline size 1:
                                       6E                                     0)
    zero, fp32      -                  4ψ + 4R                                8ψ/d
    zero, 16-bit    -                  2ψ + 2R + 4ψ/d + 4m                    4ψ/d + 8m
    zero3, d = 1    eR + 4ψ            eψ + 4ψ                                4ψ
    zero3, d > 1    eR + 4ψ/d          eψ + em + gathered weights eψ          4ψ/d
                    (while gathering, the forward also holds an all-gather's flat buffer, e·min(ψ, 5e7);
                    the gathered weights are bounded by stage3_max_live_parameters, 1e9)

lnstrain caps R at the parameters one rank holds (``zero_bucket_elements``): DeepSpeed allocates its
bucket at full size whatever the model. With several micro-batches per step the gradients of the
earlier ones are held through the later forwards.

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
  Context parallelism (N ranks) keeps the same terms for s/N tokens: ring attention keeps q, k, v, its
  output and the fp32 log-sum-exp of its own tokens, as FlashAttention does; the all-to-all form also
  keeps attention's output before its second exchange, e·(s/N)·b·h/t more. Its working set, live
  inside one layer (not beside the loss's transients: the larger of the two counts): the ring's
  key/value blocks in flight, 2·2e·(s/N)·b·h_kv/t, and an fp32 output accumulator, 4·(s/N)·b·h/t, in
  the forward; in the backward the blocks, fp32 key/value gradients travelling with them,
  2·8·(s/N)·b·h_kv/t, and an fp32 query gradient 4·(s/N)·b·h/t; the all-to-all's send and receive
  buffers for q|k|v, 2e·(s/N)·b·(h + 2h_kv)/t.
  Recomputation: ``selective`` drops C; ``full`` keeps only each layer's input, e·sbh (/t with
  sequence parallelism), and one layer's full activations exist while it is recomputed in backward.
  A 1F1B pipeline keeps min(p - stage, accumulation steps) micro-batches in flight on a stage.
The loss (last stage, V the padded vocabulary, ``model.cross_entropy``), with the final norm's and the
head's inputs (2e·sbh) kept beside it:
  * ``chunked`` (the default) keeps the logits, e·s·b·V/t, and an fp32 log-sum-exp per token for
    backward, and holds one fp32 chunk of c = min(s·b, ``chunk_tokens``) tokens at a time, 4·c·V/t, in
    forward and in backward; the logits' gradient is written over the logits. Backward then adds the
    head's gradients.
  * ``fp32_logits`` keeps fp32 log-probabilities (or the softmax), 4·s·b·V/t; the logits, e·s·b·V/t, live
    while the loss is computed, with an fp32 copy of 16-bit logits (ATen's log-softmax upcasts bf16 into a
    copy on CUDA as on the CPU; only fp16 on CUDA is read as it goes; the tensor-parallel form always
    copies). Backward starts with the logits' gradient, a 16-bit copy of the fp32 one, or the head's.

FP8 linears (``precision.fp8``) add no term: they keep what the bf16 layers keep (the high-precision
inputs and weights), and their float8 copies are transient, made one product at a time, in backward
after the loss's logits are freed (CPU engines: the peak within 0.12 MB of bf16's at the test shape).

Host memory, outside the phases: a checkpoint written in the background (``checkpoint.async_save``)
is first copied into host buffers, kept from the first save on: the bytes of the rank's checkpoint
files, its weights and optimizer state (``StageMemory.snapshot``; on data-parallel rank 0 under ZeRO
0-2, which alone writes the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from lnstrain.config.feasibility import OptimizerKind, optimizer_kind
from lnstrain.config.run_config import Config
from lnstrain.estimate.parameters import largest_tensor_elements, stage_layer_counts, stage_parameters
from lnstrain.model.config import ModelConfig
from lnstrain.parallel.cross_entropy import chunk_tokens

GIB = 1024**3
CHECKPOINTING_MODES = ("none", "selective", "full")
PHASES = ("forward", "backward", "step")
ENGINE_ALLREDUCE_BUCKET = 500_000_000
"""Elements per bucket of DeepSpeed's engine-level all-reduce (``MEMORY_OPT_ALLREDUCE_SIZE``)."""
ZERO3_PREFETCH_BUCKET = 50_000_000
"""DeepSpeed's ``stage3_prefetch_bucket_size`` default: elements of one all-gather's flat buffer."""
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's ``stage3_max_live_parameters`` default: at most this many gathered at once."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of one pipeline stage, by what they are and when they live."""

    stage: int
    layers: int
    parameters: int
    weights: float
    optimizer: float
    """fp32 master copy (where kept) and Adam's moments, ZeRO-partitioned."""
    persistent_buffers: float
    """DeepSpeed's buffers held between steps (BF16_Optimizer's fp32 gradients, ZeRO 3's bucket)."""
    activations: dict[str, float]
    """Kept for backward at the end of the forward, by checkpointing mode: every micro-batch in
    flight, and on the last stage what the loss keeps (the logits, or fp32 log-probabilities)."""
    forward_transient: float
    """Live only while the loss is computed: its fp32 chunk (``chunked``), or the logits and an fp32 copy
    of them (``fp32_logits``); or, when larger, a layer's attention working set across the context split."""
    backward_transient: float
    """At the start of backward, beside the activations: the loss's fp32 chunk or a new gradient of the
    logits, then the head's gradients, whichever is larger (or, when larger, a layer's backward working set
    across the context split)."""
    recompute: dict[str, float]
    """During backward, beside the activations: the layer being recomputed (``full``)."""
    gradients: float
    """At the end of backward: gradients and DeepSpeed's reduction buffers (the activations are gone)."""
    step: float
    """Added during the optimizer step: gradients, their fp32 copies and the step's temporaries."""
    gathered_weights: float = 0.0
    """ZeRO 3: the full weights gathered for the forward and backward."""
    forward_gather: float = 0.0
    """ZeRO 3: an all-gather's flat buffer beside the gathered weights, while it gathers (not at the end
    of the forward, when the activations and the loss peak)."""
    accumulated_gradients: float = 0.0
    """Gradients of the step's earlier micro-batches, held through the later forwards."""
    backward_buffers: float = 0.0
    """ZeRO 1/2: the reduce bucket, allocated when the backward starts, beside the activations."""
    pipe_buffers: float = 0.0
    """Pipeline: what DeepSpeed's pipe buffers keep between steps (each in-flight slot's received
    input, and on the last stage its logits, which are only dropped when the slot is reused)."""

    @property
    def held(self) -> float:
        """Held between steps: weights, optimizer state and persistent buffers."""
        return self.weights + self.optimizer + self.persistent_buffers + self.pipe_buffers

    @property
    def snapshot(self) -> float:
        """Host memory of a checkpoint snapshot (``checkpoint.async_save``): what the rank's checkpoint
        files hold, its weights and optimizer state (fp32 master, Adam moments)."""
        return self.weights + self.optimizer

    def phases(self, checkpointing: str) -> dict[str, float]:
        """Peak bytes of each phase of a steady step."""
        kept = self.activations[checkpointing]
        during = self.held + self.gathered_weights
        backward_start = (kept + self.accumulated_gradients + self.backward_transient + self.recompute[checkpointing]
                          + self.backward_buffers)
        return {"forward": during + self.accumulated_gradients + max(self.forward_gather, kept + self.forward_transient),
                "backward": during + max(backward_start, self.gradients),
                "step": self.held + self.step}

    def total(self, checkpointing: str) -> float:
        return max(self.phases(checkpointing).values())

    def peak_phase(self, checkpointing: str) -> str:
        phases = self.phases(checkpointing)
        return max(phases, key=phases.__getitem__)


@dataclass(frozen=True)
class MemoryEstimate:
    """The heaviest stage's memory for the configured layout, plus every stage for reference."""

    checkpointing: str
    stages: list[StageMemory]
    tensor: int
    pipeline: int
    data: int
    zero_stage: int
    optimizer_kind: OptimizerKind
    """The optimizer DeepSpeed wraps ours in."""
    device: str = "cuda"
    context: int = 1

    @property
    def heaviest(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total(self.checkpointing))

    @property
    def total(self) -> float:
        return self.heaviest.total(self.checkpointing)

    def total_with(self, checkpointing: str) -> float:
        return max(st.total(checkpointing) for st in self.stages)

    @property
    def snapshot(self) -> float:
        """The largest host memory a rank's checkpoint snapshot needs (``StageMemory.snapshot``)."""
        return max(st.snapshot for st in self.stages)


def layer_activation_bytes(model: ModelConfig, seq_len: int, micro_batch: int, tensor: int,
                           sequence_parallel: bool, checkpointing: str,
                           scores_stored: bool = False, element_bytes: int = 2, context: int = 1,
                           context_method: str = "ring") -> float:
    """Activation bytes one layer keeps for backward, per micro-batch, on one of ``context`` ranks
    sharing each sequence (formula in the module docstring)."""
    s, b, h, f, a = seq_len / context, micro_batch, model.hidden_size, model.ffn_hidden_size, model.num_heads
    h_kv, e = model.kv_heads * model.head_dim, element_bytes
    if checkpointing == "full":
        return e * s * b * h / (tensor if sequence_parallel else 1)
    replicated = 4 * e * s * b * h + (2 * s * b * h if model.hidden_dropout > 0 else 0)
    core = 5 * a * s * s * b if scores_stored else 4 * a * s * b
    split = e * s * b * (h + 2 * h_kv) + e * s * b * h + 3 * e * s * b * f
    if context > 1 and context_method == "all_to_all":
        split += e * s * b * h  # attention's output before the exchange back
    if checkpointing == "none":
        split += core
    return (replicated / tensor if sequence_parallel else replicated) + split / tensor


def context_attention_transients(config: Config) -> tuple[float, float]:
    """(forward, backward) bytes of one layer's attention working set across the context split, beside
    the kept activations (module docstring); zeros at context 1."""
    model, par = config.model, config.parallel
    if par.context == 1:
        return 0.0, 0.0
    s, b, e = config.data.seq_len / par.context, config.train.micro_batch_size, element_bytes(config)
    h, h_kv, t = model.hidden_size, model.kv_heads * model.head_dim, par.tensor
    if par.context_method == "all_to_all":
        buffers = 2 * e * s * b * (h + 2 * h_kv) / t
        return buffers, buffers
    blocks = 2 * 2 * e * s * b * h_kv / t
    return blocks + 4 * s * b * h / t, blocks + 2 * 8 * s * b * h_kv / t + 4 * s * b * h / t


def korthikanti_gpt_layer_bytes(model: ModelConfig, seq_len: int, micro_batch: int) -> float:
    """The paper's GPT-block reference: s·b·h·(34 + 5·a·s/h) bytes, no parallelism, no recompute."""
    s, b, h, a = seq_len, micro_batch, model.hidden_size, model.num_heads
    return s * b * h * (34 + 5 * a * s / h)


def element_bytes(config: Config) -> int:
    """Bytes of one weight, gradient or activation element in the training precision."""
    return 4 if config.precision.dtype == "fp32" else 2


def _reduce_bucket(config: Config, world_size: int) -> tuple[int, bool]:
    """(``reduce_bucket_size``, ``overlap_comm``) from the DeepSpeed JSON lnstrain derives."""
    from lnstrain.config.deepspeed_json import DEEPSPEED_BUCKET_DEFAULT, deepspeed_config

    zero = deepspeed_config(config, world_size)["zero_optimization"]
    return int(zero.get("reduce_bucket_size", DEEPSPEED_BUCKET_DEFAULT)), bool(zero.get("overlap_comm", False))


def _bf16_gradients_dropped_in_backward(config: Config, world_size: int) -> bool:
    """Whether BF16_Optimizer frees each bf16 gradient once it is added to the fp32 buffer
    (``bf16.immediate_grad_update`` in the DeepSpeed JSON lnstrain derives)."""
    from lnstrain.config.deepspeed_json import deepspeed_config

    bf16 = deepspeed_config(config, world_size).get("bf16")
    return isinstance(bf16, dict) and bool(bf16.get("immediate_grad_update", False))


@dataclass(frozen=True)
class _OptimizerTerms:
    """The optimizer's part of one stage's memory (see the table in the module docstring)."""

    optimizer: float
    persistent_buffers: float
    gradients: float
    step: float
    accumulated_gradients: float
    gathered_weights: float = 0.0
    forward_gather: float = 0.0
    backward_buffers: float = 0.0


def _optimizer_terms(config: Config, world_size: int, kind: OptimizerKind, params: int,
                     largest: int) -> _OptimizerTerms:
    d = max(config.shard_replicas(world_size), 1)  # ZeRO partitions over data × context
    e = element_bytes(config)
    flat = min(params, ENGINE_ALLREDUCE_BUCKET)  # what the engine's all-reduce flattens at once
    if kind is OptimizerKind.NONE:
        return _OptimizerTerms(8 * params, 0.0, 4 * params + 4 * flat, 4 * params + 4 * largest, 4 * params)
    if kind is OptimizerKind.FP16_UNFUSED:
        return _OptimizerTerms(12 * params, 0.0, 2 * params + 2 * flat, 6 * params, 2 * params)
    if kind is OptimizerKind.BF16_OPTIMIZER:
        bf16_grads = 0.0 if _bf16_gradients_dropped_in_backward(config, world_size) else 2 * params
        # kept and zeroed after each backward, so held through the later micro-batches' forwards
        return _OptimizerTerms(12 * params / d, 4 * params, bf16_grads + 6 * flat, bf16_grads, bf16_grads)
    bucket, overlap = _reduce_bucket(config, world_size)
    if kind is OptimizerKind.ZERO:
        bucket_bytes = e * bucket * (2 if overlap else 1)
        # ZeRO 1 accumulates in its bucket, which then stays through the next micro-batch's forward
        bucket_held = config.parallel.zero_stage == 1 and config.grad_accumulation_steps(world_size) > 1
        accumulated = e * params + bucket_bytes if config.parallel.zero_stage == 1 else 4 * params / d
        if e == 4:
            return _OptimizerTerms(12 * params / d, 0.0, 4 * params + bucket_bytes, 8 * params / d, accumulated,
                                   backward_buffers=0.0 if bucket_held else bucket_bytes)
        return _OptimizerTerms(12 * params / d, 0.0, 2 * params + bucket_bytes + 4 * params / d + 4 * largest,
                               4 * params / d + 8 * largest, accumulated)
    if d == 1:  # every partition is the whole: nothing to gather
        return _OptimizerTerms(12 * params / d, e * bucket + 4 * params, e * params + 4 * params, 4 * params,
                               4 * params)
    gathered = e * min(params, ZERO3_MAX_LIVE_PARAMETERS)
    return _OptimizerTerms(12 * params / d, e * bucket + 4 * params / d, e * params + e * largest, 4 * params / d,
                           4 * params / d, gathered, forward_gather=e * min(params, ZERO3_PREFETCH_BUCKET))


def _loss_terms(config: Config, device: str) -> tuple[float, float, float]:
    """(kept, forward transient, backward transient) bytes of the loss on the last stage (the module
    docstring). Kept besides the loss's own: the final norm's input (split by sequence parallelism) and
    its fp32 row statistic, and the head's input."""
    model, t = config.model, config.parallel.tensor
    tokens, e = config.data.seq_len * config.train.micro_batch_size // config.parallel.context, element_bytes(config)
    vocab = model.padded_vocab_size(t) / t
    head_grads = e * vocab * model.hidden_size + e * tokens * model.hidden_size
    norm_split = t if config.parallel.sequence_parallel else 1
    head_input = e * tokens * model.hidden_size * (1 + 1 / norm_split) + 4 * tokens / norm_split
    if model.cross_entropy == "chunked":
        chunk = 4 * min(tokens, chunk_tokens(int(vocab))) * vocab
        return e * tokens * vocab + 4 * tokens + head_input, chunk, max(chunk, head_grads)
    reads_as_it_goes = device == "cuda" and config.precision.dtype == "fp16" and t == 1
    upcast_copy = 4 * tokens * vocab if e < 4 and not reads_as_it_goes else 0.0
    logits_grad = e * tokens * vocab if e < 4 else 0.0
    return 4 * tokens * vocab + head_input, e * tokens * vocab + upcast_copy, max(logits_grad, head_grads)


def memory_estimate(config: Config, world_size: int, device: str = "cuda") -> MemoryEstimate:
    """Per-rank memory of ``config`` on ``world_size`` ranks (layout from ``config.parallel``).

    ``device``: ``cuda`` (the default, what the dry run plans for) or ``cpu``, whose kernels keep a
    few tensors CUDA's do not (the loss's fp32 copies of 16-bit inputs to mixed-dtype operations).
    """
    model, par = config.model, config.parallel
    tp, pp = par.tensor, par.pipeline
    dp = max(config.data_parallel_size(world_size), 1)
    replicas = max(config.shard_replicas(world_size), 1)
    accumulation = max(config.grad_accumulation_steps(world_size), 1)
    zero, e = par.zero_stage, element_bytes(config)
    s, b = config.data.seq_len, config.train.micro_batch_size
    local_tokens = s / par.context
    kind = optimizer_kind(config)
    largest = largest_tensor_elements(model, tp)
    loss_kept, loss_forward, loss_backward = _loss_terms(config, device)
    ring_forward, ring_backward = context_attention_transients(config)
    stages = []
    for stage, layers in enumerate(stage_layer_counts(model.num_layers, pp, par.pipeline_boundaries)):
        params = stage_parameters(model, tp, pp, stage, layers)
        last = stage == pp - 1
        in_flight = min(pp - stage, accumulation) if pp > 1 else 1
        per_layer = {mode: layer_activation_bytes(model, s, b, tp, par.sequence_parallel, mode, element_bytes=e,
                                                  context=par.context, context_method=par.context_method)
                     for mode in CHECKPOINTING_MODES}
        activations = {mode: layers * per_layer[mode] * in_flight + (loss_kept if last else 0.0)
                       for mode in CHECKPOINTING_MODES}
        recompute = {mode: per_layer["none"] if mode == "full" and layers else 0.0 for mode in CHECKPOINTING_MODES}
        terms = _optimizer_terms(config, world_size, kind, params, largest)
        pipe_slots = max(2, min(pp - stage, accumulation)) if pp > 1 else 0
        received = e * local_tokens * b * model.hidden_size / (tp if par.sequence_parallel else 1)
        logits = e * local_tokens * b * model.padded_vocab_size(tp) / tp
        slot_bytes = (received if stage > 0 else 0.0) + (logits if last else 0.0)
        attention_work = layers > 0
        stages.append(StageMemory(
            stage=stage, layers=layers, parameters=params,
            weights=params * e / (replicas if zero >= 3 else 1), optimizer=terms.optimizer,
            persistent_buffers=terms.persistent_buffers, activations=activations,
            forward_transient=max(loss_forward if last else 0.0, ring_forward if attention_work else 0.0),
            backward_transient=max(loss_backward if last else 0.0, ring_backward if attention_work else 0.0),
            recompute=recompute, gradients=terms.gradients, step=terms.step,
            gathered_weights=terms.gathered_weights, forward_gather=terms.forward_gather,
            accumulated_gradients=terms.accumulated_gradients if accumulation > 1 else 0.0,
            backward_buffers=terms.backward_buffers, pipe_buffers=pipe_slots * slot_bytes))
    return MemoryEstimate(checkpointing=config.train.activation_checkpointing, stages=stages,
                          tensor=tp, pipeline=pp, data=dp, zero_stage=zero, optimizer_kind=kind, device=device,
                          context=par.context)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


@dataclass(frozen=True)
class GpuAllowances:
    """What a GPU holds besides the tensors the estimate counts: stated assumptions, not measured here
    (no GPU has run lnstrain yet; ``launch/gpu_check.sh`` measures allocated and reserved peaks).

    Attributes:
        cuda_context: the CUDA context with cuBLAS and cuDNN handles and workspaces (flash attention's
            own workspace is its log-sum-exp, already among the activations): about 0.5-0.7 GiB on
            Hopper with CUDA 12/13, outside ``max_memory_allocated``.
        nccl: NCCL's buffers, about 0.25 GiB per communicator (``NCCL_BUFFSIZE`` 4 MiB per channel
            and peer, tens of channels on NVLink); one per process group of more than one rank.
        allocator_fraction: the caching allocator's reserved-but-free blocks, as a fraction of the
            tensor peak (fragmentation; ``expandable_segments:True`` lowers it).
        workspaces: GPU kernels' workspaces, allocated through the caching allocator (so inside
            ``max_memory_allocated``) but absent from the CPU's kernels the tensor terms were checked
            on: cuBLAS's 32 MiB (Hopper's default ``CUBLAS_WORKSPACE_CONFIG``) and flash attention's
            backward fp32 dQ accumulator, 4·s·b·h/t, beside the backward's peak.
    """

    cuda_context: float
    nccl: float
    allocator_fraction: float
    workspaces: float = 0.0

    def device_total(self, tensor_peak: float) -> float:
        """What ``nvidia-smi`` would show for a rank whose tensor peak is ``tensor_peak``."""
        return (tensor_peak + self.workspaces) * (1 + self.allocator_fraction) + self.cuda_context + self.nccl


def gpu_allowances(config: Config, world_size: int) -> GpuAllowances:
    par = config.parallel
    sizes = (par.tensor, par.pipeline, max(config.data_parallel_size(world_size), 1), par.context,
             config.shard_replicas(world_size) if par.context > 1 else 1, world_size)
    communicators = sum(1 for size in sizes if size > 1)
    tokens = config.data.seq_len * config.train.micro_batch_size / par.context
    attention_dq = 4 * tokens * config.model.hidden_size / par.tensor
    return GpuAllowances(cuda_context=0.6 * GIB, nccl=0.25 * GIB * communicators, allocator_fraction=0.10,
                         workspaces=32 * 2**20 + attention_dq)
