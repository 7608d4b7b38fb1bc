"""The DeepSpeed engine for any (tensor, pipeline, data) layout, behind one step API.

``build_engine`` checks the layout, builds the model (``Transformer`` at pipeline size 1, a
DeepSpeed ``PipelineModule`` otherwise; weights are drawn per name from the model's init seed, so
every layout starts from the same model), our optimizer and schedule, and ``deepspeed.initialize``.
``TrainingEngine.train_step`` then hides whether DeepSpeed runs a pipeline schedule or plain
forward/backward over the micro-batches. torch.distributed must already be initialised.

Loss: the token-weighted mean over the global batch (``lnstrain.model.loss``, weights from
``lnstrain.training.batches``); tokens with
``loss_mask`` 0 (padding, excluded tokens) add nothing to the loss, the gradient or the count.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lnstrain.config.deepspeed_json import deepspeed_config
from lnstrain.config.feasibility import check_layout, optimizer_kind, overcounted_kv_rows
from lnstrain.config.run_config import Config
from lnstrain.deepspeed_adapter import (CheckpointFileIO, accelerator_device_name, base_optimizer,
                                        call_before_pipeline_optimizer_step, checkpoint_file_io, fp16_loss_scale,
                                        load_checkpoint_files, model_parallel_group, relink_optimizer_state,
                                        restore_step_counters, write_recovery_scripts_fresh)
from lnstrain.model.build import build_model, select_triton_kernels
from lnstrain.no_follow import write_bytes_replacing
from lnstrain.model.loss import weighted_token_loss
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.training import bf16_accumulation
from lnstrain.training.batches import MicroBatch, weigh_micro_batches
from lnstrain.training.grad_clip import GradClipHook
from lnstrain.training.health import NonFiniteGradientSkip
from lnstrain.training.optimizer import build_optimizer
from lnstrain.training.schedule import LrSchedule, build_scheduler, follow_schedule, schedule_of
from lnstrain.wording import counted

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step. ``loss`` is the global batch's token-weighted mean, the same on every rank."""

    loss: float
    grad_norm: float | None
    lr: float
    loss_scale: float | None
    """The fp16 loss scale after the step (the next step's); None without fp16."""
    skipped: bool


def _check_groups_match(config: Config, groups: ParallelGroups) -> None:
    """The groups must be the config's layout; the data-parallel size, and so the world size, is theirs."""
    parallel = config.parallel
    wanted = (parallel.tensor, parallel.pipeline, parallel.context, parallel.context_method)
    actual = (groups.tp_size, groups.pp_size, groups.cp_size, groups.context_method)
    if actual != wanted:
        raise ValueError(f"process groups are (tensor, pipeline, context, context method) = {actual} but the config "
                         f"asks for {wanted}; build them with lnstrain.model.build.build_groups(config)")


def _deepspeed_json(config: Config, world_size: int) -> dict[str, Any]:
    ds_config = deepspeed_config(config, world_size)
    if config.parallel.pipeline > 1 and config.parallel.sequence_parallel:
        # DeepSpeed's pipe engine sends 1/tp of each activation and all-gathers it, which assumes
        # the tensor ranks hold the same activation; under sequence parallelism they do not.
        ds_config.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    return ds_config


def training_device() -> torch.device:
    """Where DeepSpeed will put this rank's model: the accelerator's device for ``LOCAL_RANK`` (its own
    rule), the current device without it; ``cpu`` on DeepSpeed's CPU accelerator."""
    local_rank = os.environ.get("LOCAL_RANK")
    return torch.device(accelerator_device_name(int(local_rank) if local_rank else None))


def build_engine(config: Config, groups: ParallelGroups) -> "TrainingEngine":
    """Model, optimizer, schedule and DeepSpeed engine for ``config`` on this rank of ``groups``, which
    must have the config's tensor and pipeline sizes (the world size is theirs)."""
    import deepspeed

    from lnstrain.parallel.deepspeed_comm import init_deepspeed_comm

    _check_groups_match(config, groups)
    world_size = groups.world_size
    check_layout(config, world_size)
    if not dist.is_initialized():
        raise RuntimeError("build_engine needs torch.distributed initialised (launch with torchrun or "
                           "deepspeed, or lnstrain.parallel.local_ranks.run_distributed)")
    init_deepspeed_comm(dist.get_backend())

    logger.info("building the model (%d layers, hidden size %d, %s) and the DeepSpeed engine",
                config.model.num_layers, config.model.hidden_size, config.model.norm_scheme.value)
    if overcounted_kv_rows(config):  # refused where DeepSpeed clips; kept where lnstrain does, for existing runs
        logger.warning("%s Set model.fused_qkv: false for an exact norm.", overcounted_kv_rows(config))
    device = training_device()
    module = build_model(config, groups, device.type).to(device)  # before the optimizer picks its kernel
    select_triton_kernels(module, device, config.precision.compute_dtype)
    optimizer = build_optimizer(module, config.optim)
    scheduler = build_scheduler(optimizer, LrSchedule.from_config(config))
    own_clipping = optimizer_kind(config).lnstrain_clips
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler,
        mpu=groups if groups.pp_size == 1 else None,
        config=_deepspeed_json(config, world_size))
    fused_accumulation = bf16_accumulation.install(engine.optimizer)
    write_recovery_scripts_fresh(engine, functools.partial(write_bytes_replacing, executable=True))
    logger.info("engine ready: tensor %d, context %d, pipeline %d, data %d, ZeRO-%d, %s, %s per step",
                groups.tp_size, groups.cp_size, groups.pp_size, groups.dp_size, config.parallel.zero_stage,
                config.precision.dtype, counted(engine.gradient_accumulation_steps(), "micro-batch", "micro-batches"))
    clip_hook = None
    if own_clipping:
        params = [p for p in module.parameters() if p.requires_grad]
        clip_hook = GradClipHook(params, config.optim.grad_clip, groups.tp_rank,
                                 model_parallel_group(engine))
        optimizer.register_step_pre_hook(clip_hook)
        if engine.optimizer is not optimizer:  # NonFiniteGradientSkip's overflow flag must reach DeepSpeed
            raise RuntimeError(f"DeepSpeed wrapped the fp32 ZeRO-0 optimizer in {type(engine.optimizer).__name__}; "
                               "lnstrain's own clipping and non-finite step skipping expect it unwrapped")
        optimizer.register_step_pre_hook(NonFiniteGradientSkip(lambda: clip_hook.last_norm))
    return TrainingEngine(engine, module=module, groups=groups, config=config, scheduler=scheduler,
                          clip_hook=clip_hook, fused_accumulation=fused_accumulation)


class TrainingEngine:
    """One training step over a list of micro-batches, whatever the layout, and what the rest of
    lnstrain needs of the DeepSpeed engine behind it (checkpoints, the optimizer, step counters);
    only this class holds that engine.

    Attributes:
        module: this rank's model (``Transformer`` or its pipeline stage, a ``PipelineModule``).
        groups: this rank's process groups (``groups.world_size`` is the run's world size).
        config: the run config the engine was built for.
        scheduler: the learning-rate schedule; DeepSpeed steps it after each applied optimizer step.
        clip_hook: lnstrain's own gradient clipping (fp32 without ZeRO), None where DeepSpeed clips.
        fused_accumulation: the bf16 gradient add into fp32 installed on DeepSpeed's ``BF16_Optimizer``
            (``bf16_accumulation``), None under any other optimizer.
        accumulation_steps: micro-batches per optimizer step on this rank.
    """

    def __init__(self, deepspeed_engine: DeepSpeedEngine, module: nn.Module, groups: ParallelGroups,
                 config: Config, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 clip_hook: GradClipHook | None = None,
                 fused_accumulation: bf16_accumulation.FusedGradientAdd | None = None) -> None:
        self._deepspeed = deepspeed_engine  # a PipelineEngine when pipelined
        self.module = module
        self.groups = groups
        self.config = config
        self.scheduler = scheduler
        self.clip_hook = clip_hook
        self.fused_accumulation = fused_accumulation
        self.accumulation_steps: int = deepspeed_engine.gradient_accumulation_steps()
        self._before_optimizer_step: Callable[[], None] | None = None
        if self.is_pipeline:
            # the pipe engine reduces gradients and steps inside train_batch: train_step's callback runs between
            call_before_pipeline_optimizer_step(deepspeed_engine, self._run_before_optimizer_step)

    def _run_before_optimizer_step(self) -> None:
        if self._before_optimizer_step is not None:
            self._before_optimizer_step()

    @property
    def is_pipeline(self) -> bool:
        return self.groups.pp_size > 1

    @property
    def device(self) -> torch.device:
        return self._deepspeed.device

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer (AdamW) that updates the parameters, whether or not DeepSpeed wraps it
        (ZeRO, bf16, fp16 hold the fp32 masters and the optimizer state in its parameter groups)."""
        return base_optimizer(self._deepspeed.optimizer)

    @property
    def lr_schedule(self) -> LrSchedule:
        """The learning-rate schedule the engine follows (saved in every checkpoint's metadata)."""
        return schedule_of(self.scheduler)

    def lr_schedule_record(self) -> dict[str, Any]:
        """What a checkpoint's metadata records of the schedule: the config's and the one followed."""
        return {"configured": LrSchedule.from_config(self.config).to_dict(), "in_effect": self.lr_schedule.to_dict()}

    def follow_lr_schedule(self, schedule: LrSchedule) -> None:
        """Follow ``schedule`` from the loaded step on (a resume whose schedule changed)."""
        follow_schedule(self.scheduler, schedule)

    def relink_optimizer_state(self) -> None:
        """Call after replacing ``base_optimizer``'s state tensors: DeepSpeed's per-parameter views of
        them (bf16, ZeRO-1/2) then point at the new ones."""
        relink_optimizer_state(self._deepspeed.optimizer)

    # --- checkpoints ----------------------------------------------------------------------------------
    @property
    def checkpoint_files(self) -> CheckpointFileIO:
        """What DeepSpeed writes and reads each checkpoint file through (hooked to hash, guard, observe)."""
        return checkpoint_file_io(self._deepspeed)

    def save_checkpoint(self, step_dir: Path, client_state: dict[str, Any] | None = None) -> None:
        """DeepSpeed's files of this rank (weights, optimizer, schedule, counters, ``client_state``)
        into ``step_dir``; writes no ``latest`` (collective: every rank calls it)."""
        self._deepspeed.save_checkpoint(str(step_dir.parent), tag=step_dir.name, save_latest=False,
                                        client_state=client_state or {})

    def load_checkpoint(self, step_dir: Path) -> dict[str, Any] | None:
        """Restore weights, optimizer and schedule from ``step_dir`` (saved at this layout): the
        ``client_state`` its save stored, or None when DeepSpeed found nothing to load there."""
        return load_checkpoint_files(self._deepspeed, str(step_dir.parent), step_dir.name)

    def restore_step_counters(self, counters: Mapping[str, int]) -> None:
        """DeepSpeed's step counters as a checkpoint recorded them
        (``lnstrain.deepspeed_adapter.STEP_COUNTERS``), for a load that bypasses ``load_checkpoint``."""
        restore_step_counters(self._deepspeed, counters)

    def _check_count(self, micro_batches: list[MicroBatch]) -> None:
        if len(micro_batches) != self.accumulation_steps:
            raise ValueError(f"train_step got {len(micro_batches)} micro-batches, but this layout accumulates "
                             f"{self.accumulation_steps} per step (train.global_batch_size / "
                             f"(train.micro_batch_size × data-parallel size {self.groups.dp_size}))")

    def train_step(self, micro_batches: list[MicroBatch],
                   before_optimizer_step: Callable[[], None] | None = None) -> StepResult:
        """Forward, backward and one optimizer step over this rank's share of the global batch.

        ``before_optimizer_step`` runs on every rank once the gradients are complete (reduced over
        data-parallel ranks and tied copies) and before clipping and the update: read gradients
        there with ``lnstrain.deepspeed_adapter.full_gradient``.
        """
        self._check_count(micro_batches)
        lr = self.scheduler.get_last_lr()[0]
        self._deepspeed.train()
        self._before_optimizer_step = before_optimizer_step
        try:
            if self.is_pipeline:
                loss = self._pipeline_train(micro_batches)
            else:
                loss = self._forward_backward_step(micro_batches)
        finally:
            self._before_optimizer_step = None
        return StepResult(loss=loss, grad_norm=self._grad_norm(), lr=lr, loss_scale=self.current_loss_scale(),
                          skipped=not self._deepspeed.was_step_applied())

    def _forward_backward_step(self, micro_batches: list[MicroBatch]) -> float:
        """Pipeline size 1: forward and backward of every micro-batch, then the optimizer step.
        Returns the global batch's token-weighted mean loss."""
        weighted, _ = weigh_micro_batches(micro_batches, self.groups, self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, after the step
        for index, micro in enumerate(weighted):
            # no name holds the logits: the loss alone keeps them for backward, which overwrites them
            loss = weighted_token_loss(self._deepspeed(micro.inputs), micro.labels, micro.weights, self.config.model,
                                       self.groups)
            self._deepspeed.backward(loss)
            loss_sum += loss.detach()
            if index == len(weighted) - 1 and self._before_optimizer_step is not None:
                self._before_optimizer_step()
            self._deepspeed.step()
        return self._global_mean(loss_sum / len(weighted))

    def _global_mean(self, local_mean_contribution: torch.Tensor) -> float:
        # Each rank holds the mean of its weighted micro-batch losses over its tokens (its context chunks);
        # DeepSpeed's average over its data-parallel ranks, data × context.
        value = local_mean_contribution.reshape(1)
        if self.groups.dcp_size > 1:
            dist.all_reduce(value, group=self.groups.dcp_group)
            value /= self.groups.dcp_size
        return value.item()

    def _pipeline_batches(self, micro_batches: list[MicroBatch]) -> list[tuple]:
        weighted, _ = weigh_micro_batches(micro_batches, self.groups)
        return [(m.inputs, (m.labels, m.weights)) for m in weighted]

    def _pipeline_train(self, micro_batches: list[MicroBatch]) -> float:
        loss = self._deepspeed.train_batch(data_iter=iter(self._pipeline_batches(micro_batches)))
        return float(loss.item())

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> float:
        """Token-weighted mean loss over the micro-batches of every data-parallel rank, no update."""
        self._deepspeed.eval()
        try:
            if self.is_pipeline:
                loss = self._deepspeed.eval_batch(data_iter=iter(self._pipeline_batches(micro_batches)),
                                              num_micro_batches=len(micro_batches))
                return float(loss.item())
            weighted, _ = weigh_micro_batches(micro_batches, self.groups, self.device)
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for micro in weighted:
                total += weighted_token_loss(self._deepspeed(micro.inputs), micro.labels, micro.weights,
                                             self.config.model, self.groups)
            return self._global_mean(total / len(weighted))
        finally:
            self._deepspeed.train()

    def _grad_norm(self) -> float | None:
        if self.clip_hook is not None:
            return self.clip_hook.last_norm
        norm = self._deepspeed.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def current_loss_scale(self) -> float | None:
        """The fp16 loss scale the next backward uses (None without fp16). DeepSpeed updates it inside
        the optimizer step, so read after a step it is the next step's, not that step's."""
        if not self._deepspeed.fp16_enabled():
            return None
        return fp16_loss_scale(self._deepspeed.optimizer)

    @property
    def global_step(self) -> int:
        """The optimizer steps DeepSpeed has counted (its ``global_steps``)."""
        return self._deepspeed.global_steps
