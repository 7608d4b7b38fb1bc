"""Optimizer, schedule, precision, and the shape and length of training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule.

    Attributes:
        name: ``adam`` (the LNS paper's choice, no weight decay) or ``adamw`` (decoupled decay).
        lr: peak learning rate, reached at the end of warmup.
        min_lr_ratio: the schedule decays to ``lr * min_lr_ratio``.
        weight_decay: applied to matrices only (never to norms, gains or biases); must be 0 for ``adam``.
        beta1, beta2, eps: Adam moments.
        grad_clip: global gradient-norm clipping threshold; 0 disables clipping.
        warmup_steps: linear warmup length in steps; when unset, ``warmup_fraction`` of the run.
        warmup_fraction: warmup as a fraction of total steps (the paper uses 0.1).
        decay: shape after warmup: ``cosine``, ``linear`` or ``constant``.
        schedule_change: what a resume does when this schedule (``lr``, warmup, ``decay``,
            ``min_lr_ratio`` or the run's length: a longer ``train.steps``) differs from the one the
            checkpoint was trained with; a warning names what changed and the learning rate before and
            after. ``decay``: from the checkpoint's current learning rate, ``decay``'s shape down to
            ``lr * min_lr_ratio`` at the new last step (no jump); ``stretch``: the new schedule as if the
            run had always had it (the learning rate jumps to it); ``keep``: the checkpoint's schedule,
            at its minimum past its last step (lnstrain/training/schedule.py, docs/training.md).
    """

    name: Literal["adam", "adamw"] = "adamw"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int | None = None
    warmup_fraction: float = 0.1
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    schedule_change: Literal["decay", "stretch", "keep"] = "decay"

    def validate(self) -> list[str]:
        problems = []
        if not self.lr > 0:
            problems.append(f"optim.lr must be > 0 (got {self.lr})")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"optim.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        if self.weight_decay < 0:
            problems.append(f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        if self.name == "adam" and self.weight_decay > 0:
            problems.append("optim.weight_decay > 0 with optim.name: adam couples decay to the "
                            "gradient; use optim.name: adamw for decoupled weight decay")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                problems.append(f"optim.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.grad_clip < 0:
            problems.append(f"optim.grad_clip must be >= 0 (got {self.grad_clip})")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            problems.append(f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if not 0 <= self.warmup_fraction < 1:
            problems.append(f"optim.warmup_fraction must be in [0, 1) (got {self.warmup_fraction})")
        return problems


@dataclass
class PrecisionConfig:
    """Numeric precision.

    Attributes:
        dtype: ``bf16`` (fp32 master weights), ``fp16`` (dynamic loss scaling) or ``fp32``.
        fp32_grad_accum: with bf16, accumulate gradients across micro-batches in fp32.
        fp8: the transformer blocks' linear layers compute in float8 with dynamic scaling
            (``lnstrain.parallel.float8``): ``tensorwise`` (one scale per tensor; e4m3 for activations and
            weights, e5m2 for gradients) or ``rowwise`` (one power-of-two scale per row, e4m3 throughout),
            torchao's recipes of those names; ``none`` (the default) computes in ``dtype``. Only with
            ``dtype: bf16``, and on a GPU of compute capability 8.9 or newer (on the CPU it runs, slowly,
            for tests). A compute choice: weights, optimizer state and checkpoints are unchanged, so a run
            may resume with or without it; the embedding and the output head stay in bf16. MFU is still
            counted against the bf16 peak.
        initial_loss_scale_power: fp16 only: the first loss scale is 2**this.
        loss_scale_window: fp16 only: steps without overflow before the scale doubles.
        hysteresis: fp16 only: overflows tolerated before the scale halves.
        min_loss_scale: fp16 only: the scale never drops below this.
    """

    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    fp32_grad_accum: bool = True
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    initial_loss_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    @property
    def compute_dtype(self) -> torch.dtype:
        """The torch dtype the transformer layers compute in (the weights' under DeepSpeed, autocast's in the plain runners)."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]

    def validate(self) -> list[str]:
        problems = []
        if not 0 <= self.initial_loss_scale_power <= 40:
            problems.append(f"precision.initial_loss_scale_power must be in [0, 40] "
                            f"(got {self.initial_loss_scale_power})")
        if self.loss_scale_window < 1:
            problems.append(f"precision.loss_scale_window must be >= 1 (got {self.loss_scale_window})")
        if self.fp8 != "none" and self.dtype != "bf16":
            problems.append(f"precision.fp8 {self.fp8} needs precision.dtype: bf16 (got {self.dtype}): its products "
                            "return bf16, and fp16's loss scaling would meet scales of its own; set "
                            "precision.dtype: bf16, or precision.fp8: none")
        return problems


@dataclass
class TrainConfig:
    """Batch shape, length of the run and evaluation.

    Attributes:
        global_batch_size: sequences per optimizer step over all data-parallel ranks.
        micro_batch_size: sequences per forward pass on one rank; gradient accumulation makes up
            the rest (global = micro × accumulation × data-parallel size).
        steps: length of the run in optimizer steps; exactly one of ``steps`` and ``tokens``.
        tokens: length of the run in training tokens (rounded up to whole steps).
        seed: seeds weights, data order and dropout.
        eval_interval: evaluate on held-out data every this many steps (and at the end); 0: only at the end.
        eval_batches: global batches per evaluation.
        eval_tasks: lm-evaluation-harness tasks (lm-eval's names, e.g. ``[hellaswag, arc_easy]``) rank 0
            runs on checkpoints during training (``pip install 'lnstrain[eval]'``): on those saved at
            multiples of ``eval_tasks_interval`` and on the final one, each once its save is published
            (with ``checkpoint.async_save``, at a later step boundary), through the Hugging Face export
            in memory, as ``tools/evaluate.py`` does. The other ranks wait at their next collective, so
            one evaluation must take less than ``collective_timeout_minutes`` (``eval_tasks_limit``).
        eval_tasks_interval: evaluate ``eval_tasks`` on the checkpoint of every step that is a multiple
            of this (a multiple of ``checkpoint.interval_steps``); 0: on the final checkpoint only.
        eval_tasks_include_path: directories of task YAMLs of your own (lm-eval's ``--include_path``).
        eval_tasks_limit: at most this many documents per task (below 1: that share); unset: all.
        activation_checkpointing: ``none``, ``full`` (recompute each layer) or ``selective``
            (recompute attention only).
        compile: compile each transformer layer with ``torch.compile``: ``auto`` (the default) on CUDA
            wherever it composes with the layout (every ZeRO stage but 3), not on the CPU (the first
            compilation costs more than it saves there); ``true`` anywhere it composes; ``false`` never.
        compile_backend: ``torch.compile``'s backend: ``inductor`` (generates fused kernels) or
            ``aot_eager`` (traces forward and backward without generating kernels: for debugging a
            compiled run, and the CPU tests of how compilation composes with each layout).
        exit_after_minutes: save and stop cleanly (every rank after the same step, exit status 75)
            before this many minutes have passed since training started in this process (Megatron-LM's
            ``--exit-duration-in-mins``); for a job time limit without a warning signal. The margin
            kept is the slowest step plus the slowest save seen so far.
        nonfinite_policy: what a step with a non-finite loss or output does (its update is never
            applied): ``skip`` (go on with the next batch), ``stop`` (save the last good weights and
            exit with status 3) or ``rollback`` (reload the last checkpoint and never train on the
            offending global batches again; the skipped ranges are kept in later checkpoints).
        max_nonfinite_in_a_row: ``skip``: stop (save, exit 3) after this many non-finite steps in a
            row; ``rollback``: stop after this many rollbacks without a checkpoint in between.
        spike_window: steps of finite losses a loss spike is measured against; 0 disables detection.
        spike_zscore: a loss more than this many standard deviations above the window's mean is
            logged (and counted) as a spike.
        collective_timeout_minutes: a collective that waits this long (a peer hung, or its machine
            vanished without closing its connections) raises, so the job exits instead of hanging; a
            peer process that dies is noticed at once (gloo and NCCL see its connections close).
        stack_dump_after_minutes: an iteration of the training loop (step, evaluation, save) that
            takes this long writes every thread's Python stack to each rank's stderr, and again each
            time as long again passes (``stack_dumps.py``); below ``collective_timeout_minutes``, a
            hang shows where each rank waits before the timeout ends the job. Unset: only on SIGUSR2
            and fatal signals.
        skip_sample_ranges: ``[start, end)`` ranges of consumed samples never trained on, e.g.
            ``[[4096, 8192]]`` to skip known-bad data (the data position jumps over them).
    """

    global_batch_size: int = 512
    micro_batch_size: int = 8
    steps: int | None = None
    tokens: int | None = None
    seed: int = 1234
    eval_interval: int = 1000
    eval_batches: int = 10
    eval_tasks: list[str] = field(default_factory=list)
    eval_tasks_interval: int = 0
    eval_tasks_include_path: list[str] = field(default_factory=list)
    eval_tasks_limit: float | None = None
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool | Literal["auto"] = "auto"
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    exit_after_minutes: float | None = None
    nonfinite_policy: Literal["skip", "stop", "rollback"] = "skip"
    max_nonfinite_in_a_row: int = 10
    spike_window: int = 100
    spike_zscore: float = 6.0
    skip_sample_ranges: list[list[int]] = field(default_factory=list)
    collective_timeout_minutes: float = 10.0
    stack_dump_after_minutes: float | None = None

    def validate(self) -> list[str]:
        problems = []
        if self.global_batch_size < 1:
            problems.append(f"train.global_batch_size must be >= 1 (got {self.global_batch_size})")
        if self.micro_batch_size < 1:
            problems.append(f"train.micro_batch_size must be >= 1 (got {self.micro_batch_size})")
        if (self.steps is None) == (self.tokens is None):
            problems.append("give exactly one of train.steps and train.tokens "
                            f"(got steps={self.steps}, tokens={self.tokens})")
        for key in ("steps", "tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                problems.append(f"train.{key} must be >= 1 (got {value})")
        if self.eval_interval < 0 or self.eval_batches < 0:
            problems.append("train.eval_interval and train.eval_batches must be >= 0")
        if self.eval_tasks_interval < 0:
            problems.append(f"train.eval_tasks_interval must be >= 0 (got {self.eval_tasks_interval})")
        if self.eval_tasks_limit is not None and self.eval_tasks_limit <= 0:
            problems.append(f"train.eval_tasks_limit must be > 0 (got {self.eval_tasks_limit})")
        if self.exit_after_minutes is not None and self.exit_after_minutes <= 0:
            problems.append(f"train.exit_after_minutes must be > 0 (got {self.exit_after_minutes})")
        if self.nonfinite_policy not in ("skip", "stop", "rollback"):
            problems.append(f"train.nonfinite_policy must be skip, stop or rollback (got {self.nonfinite_policy!r})")
        if self.max_nonfinite_in_a_row < 1:
            problems.append(f"train.max_nonfinite_in_a_row must be >= 1 (got {self.max_nonfinite_in_a_row})")
        if self.spike_window < 0 or (self.spike_window and self.spike_window < 2):
            problems.append(f"train.spike_window must be 0 (off) or >= 2 (got {self.spike_window})")
        if self.spike_zscore <= 0:
            problems.append(f"train.spike_zscore must be > 0 (got {self.spike_zscore})")
        if self.collective_timeout_minutes <= 0:
            problems.append(f"train.collective_timeout_minutes must be > 0 (got {self.collective_timeout_minutes})")
        if self.stack_dump_after_minutes is not None and self.stack_dump_after_minutes <= 0:
            problems.append("train.stack_dump_after_minutes must be > 0, or unset for no timed dumps "
                            f"(got {self.stack_dump_after_minutes})")
        for entry in self.skip_sample_ranges:
            if len(entry) != 2 or not 0 <= entry[0] < entry[1]:
                problems.append(f"train.skip_sample_ranges: {entry} is not a [start, end) range with "
                                "0 <= start < end")
        return problems
