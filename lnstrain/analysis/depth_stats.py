"""Per-layer statistics during training, for TensorBoard and W&B: the Curse of Depth as it happens.

Every `interval` steps the trainer arms the collector before the step and collects after it:

    depth_stats = DepthStatsCollector(model, groups, cfg.logging.depth_stats_interval,
                                      num_layers=cfg.model.num_layers, loss_scale=current_loss_scale)
    ...
    armed = depth_stats.wants(step)
    if armed:
        depth_stats.arm()
    engine.train_step(batch, before_optimizer_step=depth_stats.read_parameter_grads if armed else None)
    if armed:
        stats = depth_stats.collect(step)    # collective: every rank calls it
        metrics.record_depth_stats(stats, step)   # rank 0: scalars and profiles to TensorBoard and W&B

Per global layer number l (tags `depth/<stat>/layer_07`):
- residual_variance: variance of all elements of layer l's output (the residual stream);
- grad_norm: norm of the gradient of layer l's parameters, read by `read_parameter_grads` (the
  engine's `before_optimizer_step` callback: reduced, before clipping; not logged on steps where
  it was not called);
- output_grad_norm: norm of the step loss's gradient with respect to layer l's output activations
  (all tokens of the step; the loss is the mean over DeepSpeed's data-parallel ranks, lnstrain's
  data × context ranks, and micro-batches, as DeepSpeed defines it);
- attention_to_residual, mlp_to_residual: ||sublayer contribution|| / ||residual it is added
  to||, both summed over tokens. The contribution is the change of the residual stream (for
  Post-LN blocks, which are not additive, the change across the sublayer and its norm).

fp16 loss scale: both gradient norms are divided by the scale that multiplied the loss in the
step's backward passes, which the parameter gradients (read before the optimizer step) and the
output gradients (seen during backward) both carry. `current_loss_scale` (a callable: the scale
the next backward will use, None without one) is read in `arm`. It cannot be read after the step:
DeepSpeed's dynamic loss scaler updates it inside the optimizer step (x2 after
`loss_scale_window` clean steps, /2 on overflow), so that value is off by 2 on exactly those steps.

Hooks exist only on armed steps, so other steps cost nothing. Sums stay on the device until
`collect`, which all-reduces one [num_layers, 9] float64 tensor over the whole world: layers a
pipeline stage lacks are zeros there, data-parallel and context ranks add their tokens, and
tensor-parallel ranks add only what they own (sequence shards under sequence parallelism, else rank
0 only). Forward hooks that fire inside backward (activation recomputation) are ignored. Parameter
gradients are full (reduced) on every data-parallel and context rank, so the first of them counts them;
tensor-parallel shards (`tensor_model_parallel`) count on every tensor rank, replicated parameters
on tensor rank 0.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lnstrain.deepspeed_adapter import full_gradient
from lnstrain.model.block import TransformerBlock
from lnstrain.model.norm_schemes import Placement

if TYPE_CHECKING:
    from lnstrain.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)

STATS = ("residual_variance", "grad_norm", "output_grad_norm", "attention_to_residual", "mlp_to_residual")
TAG_PREFIX = "depth"
PROFILE_PREFIX = "depth_profile"

# Columns of the per-layer sums.
_ELEMENTS, _SUM, _SQ_OUT, _SQ_IN, _SQ_ATTENTION, _SQ_MID, _SQ_MLP, _SQ_GRAD, _SQ_PARAM_GRAD = range(9)
_NUM_SUMS = 9


def stat_tag(stat: str, layer_number: int, num_layers: int) -> str:
    """`depth/<stat>/layer_<l>`, zero-padded so that tags sort by depth."""
    width = max(2, len(str(num_layers)))
    return f"{TAG_PREFIX}/{stat}/layer_{layer_number:0{width}d}"


def layer_profiles(stats: dict[str, float]) -> dict[str, list[float]]:
    """{stat: [value of layer 1, ..., value of layer L]} from `collect`'s tags."""
    profiles: dict[str, dict[int, float]] = {}
    for tag, value in stats.items():
        prefix, stat, layer = tag.split("/")
        if prefix == TAG_PREFIX:
            profiles.setdefault(stat, {})[int(layer.removeprefix("layer_"))] = value
    return {stat: [by_layer[n] for n in sorted(by_layer)] for stat, by_layer in profiles.items()}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _sum_squares(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().pow(2).sum().double()


class DepthStatsCollector:
    """Collects per-layer residual-stream statistics on every `interval`-th step (0: never).

    module: anything containing this rank's `TransformerBlock`s (a `Transformer`, a pipeline
    stage, the DeepSpeed engine's module). num_layers: the model's total L; if omitted it is
    found with one all-reduce at the first collect. loss_scale: returns the factor the next
    backward multiplies the loss by (the fp16 loss scale; None or 1.0 when the loss is not
    scaled); read in `arm`, before the step's backward and optimizer step.
    """

    def __init__(self, module: nn.Module, groups: ParallelGroups, interval: int,
                 num_layers: int | None = None,
                 loss_scale: Callable[[], float | None] | None = None) -> None:
        if interval < 0:
            raise ValueError(f"logging.depth_stats_interval must be >= 0 (got {interval})")
        self.groups = groups
        self.interval = interval
        self.blocks = sorted((m for m in module.modules() if isinstance(m, TransformerBlock)),
                             key=lambda block: block.layer_number)
        self.num_layers = num_layers
        if num_layers is not None and any(b.layer_number > num_layers for b in self.blocks):
            raise ValueError(f"num_layers={num_layers} but this rank holds layer "
                             f"{max(b.layer_number for b in self.blocks)}")
        # Hidden states are replicated over tensor-parallel ranks unless sequence-sharded.
        self.counts_here = groups.sequence_parallel or groups.tp_rank == 0
        self.device = next(module.parameters()).device
        self._handles: list[Any] = []
        self._armed = False
        self._loss_scale_source = loss_scale
        self._step_loss_scale: float | None = None
        self._sums: dict[int, torch.Tensor] = {}
        self._param_grad_squares: dict[int, torch.Tensor] = {}
        self._read_parameter_grads = False
        self._inputs: dict[int, torch.Tensor] = {}
        self._middles: dict[int, torch.Tensor] = {}

    def wants(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    @property
    def armed(self) -> bool:
        return self._armed

    def arm(self) -> None:
        """Install the hooks for the coming step (forward and backward of all its micro-batches)."""
        if self._armed:
            return
        self._armed = True
        if self._loss_scale_source is not None:
            scale = self._loss_scale_source()
            self._step_loss_scale = None if scale is None else float(scale)
        if not self.counts_here:
            return
        for block in self.blocks:
            number = block.layer_number
            self._sums[number] = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=self.device)
            self._handles.append(block.register_forward_pre_hook(self._block_input_hook(number)))
            self._handles.append(block.register_forward_hook(self._block_output_hook(number)))
            if block.layout.placement == Placement.POST:
                self._handles.append(block.attention_norm.register_forward_hook(
                    lambda _m, _args, out, n=number: self._middle(n, out)))
            else:
                self._handles.append(block.mlp_norm.register_forward_pre_hook(
                    lambda _m, args, n=number: self._middle(n, args[0])))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False
        self._inputs.clear()
        self._middles.clear()

    def _block_input_hook(self, number: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            if not _in_backward():
                self._inputs[number] = args[0].detach()
        return hook

    def _middle(self, number: int, middle: torch.Tensor) -> None:
        if _in_backward() or number not in self._inputs:
            return
        middle = middle.detach()
        sums = self._sums[number]
        sums[_SQ_IN] += _sum_squares(self._inputs[number])
        sums[_SQ_ATTENTION] += _sum_squares(middle - self._inputs.pop(number))
        sums[_SQ_MID] += _sum_squares(middle)
        self._middles[number] = middle

    def _block_output_hook(self, number: int):
        def hook(_module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
            if _in_backward() or number not in self._middles:
                return
            sums = self._sums[number]
            out = output.detach().float()
            sums[_ELEMENTS] += out.numel()
            sums[_SUM] += out.sum().double()
            sums[_SQ_OUT] += out.pow(2).sum().double()
            sums[_SQ_MLP] += _sum_squares(output.detach() - self._middles.pop(number))
            if output.requires_grad:
                output.register_hook(lambda grad: self._add_grad(number, grad))
        return hook

    def _add_grad(self, number: int, grad: torch.Tensor) -> None:
        if number in self._sums:
            self._sums[number][_SQ_GRAD] += _sum_squares(grad)

    def read_parameter_grads(self) -> None:
        """Add up each layer's squared parameter gradients: the `before_optimizer_step` callback of
        `TrainingEngine.train_step` (gradients complete and reduced, not yet clipped). Every rank
        calls it (ZeRO assembles gradients collectively)."""
        self._read_parameter_grads = True
        counts_on_dp = self.groups.dcp_rank == 0
        for block in self.blocks:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for param in block.parameters():
                if not param.requires_grad:
                    continue
                grad = full_gradient(param)  # collective under ZeRO/bf16: every data-parallel rank asks
                counted = getattr(param, "tensor_model_parallel", False) or self.groups.tp_rank == 0
                if grad is not None and counted and counts_on_dp:
                    total += _sum_squares(grad)
            self._param_grad_squares[block.layer_number] = total

    def _global_num_layers(self, device: torch.device) -> int:
        if self.num_layers is None:
            local = torch.tensor([max((b.layer_number for b in self.blocks), default=0)], device=device)
            if dist.is_initialized():
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
            self.num_layers = int(local.item())
        return self.num_layers

    def collect(self, step: int, loss_scale: float | None = None) -> dict[str, float]:
        """Remove the hooks and return {tag: value} for every layer of the model, on every rank.

        Collective over the default process group: every rank must call it on the same steps.
        loss_scale: only for a collector built without a `loss_scale` source (which wins when
        given): the scale that multiplied this step's loss in backward, read before the optimizer
        step; None: the loss was not scaled.
        """
        self.disarm()
        if self._loss_scale_source is not None:
            loss_scale = self._step_loss_scale
        self._step_loss_scale = None
        num_layers = self._global_num_layers(self.device)
        table = torch.zeros(num_layers, _NUM_SUMS, dtype=torch.float64, device=self.device)
        for number, sums in self._sums.items():
            table[number - 1] = sums
        for number, squares in self._param_grad_squares.items():
            table[number - 1, _SQ_PARAM_GRAD] = squares
        read_parameter_grads, self._read_parameter_grads = self._read_parameter_grads, False
        self._sums.clear()
        self._param_grad_squares.clear()
        if dist.is_initialized():
            dist.all_reduce(table)
        table = table.cpu()
        missing = [n + 1 for n in range(num_layers) if table[n, _ELEMENTS] == 0]
        if missing:
            raise RuntimeError(f"depth stats at step {step}: no forward pass seen for layers {missing}; "
                               "arm() must come before the step's forward passes")
        return self._scalars(table, loss_scale or 1.0, read_parameter_grads)

    def _scalars(self, table: torch.Tensor, loss_scale: float, read_parameter_grads: bool) -> dict[str, float]:
        num_layers = table.shape[0]
        dp = self.groups.dcp_size  # the loss's average, as DeepSpeed takes it
        scalars = {}
        for index, row in enumerate(table.tolist()):
            number = index + 1
            mean = row[_SUM] / row[_ELEMENTS]
            values = {
                "residual_variance": max(row[_SQ_OUT] / row[_ELEMENTS] - mean * mean, 0.0),
                "grad_norm": math.sqrt(row[_SQ_PARAM_GRAD]) / loss_scale,
                "output_grad_norm": math.sqrt(row[_SQ_GRAD]) / (dp * loss_scale),
                "attention_to_residual": math.sqrt(row[_SQ_ATTENTION] / max(row[_SQ_IN], 1e-30)),
                "mlp_to_residual": math.sqrt(row[_SQ_MLP] / max(row[_SQ_MID], 1e-30)),
            }
            for stat in STATS:
                if stat == "grad_norm" and not read_parameter_grads:
                    continue
                scalars[stat_tag(stat, number, num_layers)] = values[stat]
        return scalars
