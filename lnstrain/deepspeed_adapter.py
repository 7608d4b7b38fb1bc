"""Everything lnstrain uses of DeepSpeed beyond its public training API, in one module.

The rest of lnstrain calls only DeepSpeed's public API: ``deepspeed.initialize`` and
``init_distributed``, ``deepspeed.comm``, ``deepspeed.pipe.PipelineModule``/``LayerSpec``/
``TiedLayerSpec``, the engine's documented methods (``backward``, ``step``, ``train_batch``,
``eval_batch``, ``save_checkpoint``, ``load_checkpoint``, ...) and the JSON config. What follows is
what a DeepSpeed upgrade can break, so it is checked here first.

Tested with DeepSpeed 0.19.8 (every test of the suite; ``setup.py`` pins ``>=0.19,<0.20``).

Documented helpers outside the core API:

* ``deepspeed.accelerator.get_accelerator``: the device DeepSpeed puts the model on;
* ``deepspeed.utils.safe_get_full_grad``, ``safe_set_full_fp32_param``,
  ``safe_set_full_optimizer_state``: a parameter's gradient, fp32 master and optimizer state
  across ZeRO partitions;
* ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``, with the module's
  ``torch`` global replaced so that every file it opens goes through our loader;
* ``deepspeed.utils.logging.set_log_level_from_string``.

Internals (no stability promise):

* ``PipelineEngine._INSTRUCTION_MAP`` and ``deepspeed.runtime.pipe.schedule.OptimizerStep``: a
  callback between the pipe engine's gradient reduction and its optimizer step;
* ``deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology``: DeepSpeed's rank grid, and the
  pipeline module's ``_grid`` (``PipelineParallelGrid``: its ``pp_group``, ``dp_group``,
  ``slice_group``, ``get_stage_id``), which lnstrain checks against its own groups;
* ``PipelineModule._partition_layers`` (with ``parts``, ``_topo``, ``_set_bounds``) and
  ``_count_layer_params``, overridden: stage boundaries lnstrain chooses, parameters counted on the
  meta device;
* ``deepspeed.accelerator.set_accelerator`` and ``deepspeed.accelerator.cpu_accelerator.CPU_Accelerator``
  (its ``get_op_builder``/``create_op_builder``): the CPU accelerator without its JIT-compiled
  comm ops;
* ``deepspeed.runtime.config.DeepSpeedConfig`` (and the names of its pydantic section models) and
  ``deepspeed.utils.logger``: DeepSpeed's own check of the JSON lnstrain derives;
* the engine's ``checkpoint_engine`` (its ``save``/``load``, every checkpoint file goes through
  them), ``deepspeed.runtime.checkpoint_engine.TorchCheckpointEngine`` and its
  ``zipfile_serialization``;
* the engine's step counters ``global_steps``, ``global_samples``, ``skipped_steps``;
* the engine's ``mpu``: the groups lnstrain passed to ``initialize``, or for a pipeline engine the
  ``PipelineParallelGrid`` it took from the module, whose ``get_model_parallel_group`` spans one
  data-parallel replica's tensor and pipeline ranks (the group lnstrain's own clipping sums over);
* optimizer wrappers (ZeRO, bf16, fp16): the torch optimizer in ``.optimizer``, the fp16 scale in
  ``cur_scale`` (``FP16_Optimizer``) or ``loss_scale`` (ZeRO), ``_lazy_init_hp_params_optimizer_state``
  and ``_hp_optimizer_states_linked`` (the per-parameter views of flat optimizer state);
* parameter attributes: ``_hp_mapping`` (a fp32 master fragment exists), ``_hp_grad`` (the gradient
  lives in the wrapper's partitions), ``ds_tensor`` (ZeRO-3's local partition);
* ``BF16_Optimizer`` and the engine's ``_load_zero_checkpoint``: resuming bf16 with pipeline stages
  at ZeRO 0, which DeepSpeed's own ``load_checkpoint`` cannot (``load_checkpoint_files``);
* the record classes DeepSpeed pickles into its checkpoint files: ``fragment_address``,
  ``ZeroStageEnum``, ``LossScaler``, ``DynamicLossScaler``;
* the engine's ``_copy_recovery_script`` (``zero_to_fp32.py`` and ``zero_to_torch.py`` copied into the
  checkpoint directory at every ZeRO save, and made executable), replaced on the instance by
  ``write_recovery_scripts_fresh``.

DeepSpeed is imported inside the functions: importing it takes seconds, and it must not happen
before ``lnstrain.parallel.deepspeed_comm`` has chosen the accelerator. ``tests/test_deepspeed_boundary.py``
fails when another module of lnstrain imports more of DeepSpeed than the public API above.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

STEP_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
"""The engine's counters a checkpoint restores (read from its model-states file)."""


class CheckpointFileIO(Protocol):
    """The object a DeepSpeed engine writes and reads every checkpoint file through (its
    ``checkpoint_engine``); lnstrain replaces ``save``/``load`` on the instance for a save or load."""

    def save(self, state_dict: Any, path: str) -> Any: ...

    def load(self, path: str, map_location: Any = None) -> Any: ...


# --- devices and ranks --------------------------------------------------------------------------------
def accelerator_device_name(local_rank: int | None) -> str:
    """The device DeepSpeed puts this rank's model on: the accelerator's device for ``local_rank``,
    its current device without one (``cpu`` on the CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.device_name(local_rank) if local_rank is not None else accelerator.current_device_name()


JIT_COMM_OP_BUILDERS = ("ShareMemCommBuilder", "CCLCommBuilder")
"""The CPU accelerator's op builders that ``deepspeed.comm`` would compile at start-up."""


def use_cpu_accelerator_without_jit_ops() -> bool:
    """If DeepSpeed's accelerator is its CPU one: replace it (``set_accelerator``) with a subclass whose
    ``JIT_COMM_OP_BUILDERS`` are absent, so that ``deepspeed.comm`` compiles nothing. True when it was
    replaced now. Set ``DS_ACCELERATOR`` first, if at all: this imports DeepSpeed, which chooses then."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    current = get_accelerator()
    without_jit_ops = _cpu_accelerator_without_jit_ops_class()
    if not isinstance(current, CPU_Accelerator) or isinstance(current, without_jit_ops):
        return False
    set_accelerator(without_jit_ops())
    return True


@functools.cache
def _cpu_accelerator_without_jit_ops_class() -> type:
    """Defined on first use: it derives from DeepSpeed's class, and importing DeepSpeed takes seconds."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class CpuAcceleratorWithoutJitOps(CPU_Accelerator):
        """DeepSpeed's CPU accelerator without the comm ops that would be JIT-compiled at start-up."""

        def get_op_builder(self, class_name):
            if class_name in JIT_COMM_OP_BUILDERS:
                return None
            return super().get_op_builder(class_name)

        def create_op_builder(self, op_name):
            if op_name in JIT_COMM_OP_BUILDERS:
                return None
            return super().create_op_builder(op_name)

    return CpuAcceleratorWithoutJitOps


def pipeline_topology(tensor: int, pipeline: int, data: int) -> PipeModelDataParallelTopology:
    """DeepSpeed's rank grid for a pipeline module: axes (pipe, data, model), slowest to fastest."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pipeline, num_mp=tensor, num_dp=data)


def pipeline_grid_coords(tensor: int, pipeline: int, data: int) -> list[tuple[int, int, int]]:
    """(pipe, data, model) coordinates DeepSpeed's pipeline grid gives each global rank, in rank order."""
    topology = pipeline_topology(tensor, pipeline, data)
    coords = [topology.get_coord(rank) for rank in range(tensor * pipeline * data)]
    return [(coord.pipe, coord.data, coord.model) for coord in coords]


def set_log_level(level: str) -> None:
    """DeepSpeed's own logger level (``"info"``, ``"warning"``, ...)."""
    from deepspeed.utils.logging import set_log_level_from_string

    set_log_level_from_string(level)


# --- the pipeline module ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineGridRanks:
    """The global ranks of this rank's groups in a pipeline module's grid, and its stage."""

    pipe: list[int]
    data: list[int]
    model: list[int]
    stage: int


def pipeline_module(layers: Sequence[LayerSpec], *, tensor: int, pipeline: int, data: int,
                    stage_parts: list[int] | None = None, **options: Any) -> PipelineModule:
    """DeepSpeed's ``PipelineModule(layers, topology=pipeline_topology(...), **options)``, changed twice.

    ``stage_parts`` (``pipeline + 1`` entry indices, first 0, last ``len(layers)``): stage ``s`` holds
    ``layers[stage_parts[s]:stage_parts[s + 1]]`` and ``partition_method`` is not used; DeepSpeed 0.19
    has no explicit-boundary method. And the parameter counting its partition methods do builds every
    layer of the whole model on every rank: here it builds them on the meta device (shapes only, no
    memory, no init). Both override private ``PipelineModule`` methods.
    """
    return _pipeline_module_class()(list(layers), stage_parts=stage_parts,
                                    topology=pipeline_topology(tensor, pipeline, data), **options)


def pipeline_grid_ranks(module: PipelineModule) -> PipelineGridRanks:
    """The groups DeepSpeed's pipeline grid (the module's, which its engine communicates over) puts
    this rank in."""
    grid = module._grid
    return PipelineGridRanks(pipe=list(grid.pp_group), data=list(grid.dp_group), model=list(grid.slice_group),
                             stage=grid.get_stage_id())


@functools.cache
def _pipeline_module_class() -> type:
    """Defined on first use: it derives from DeepSpeed's class, and importing DeepSpeed takes seconds."""
    from deepspeed.pipe import PipelineModule

    class LnsPipelineModule(PipelineModule):
        """``PipelineModule`` with explicit stage boundaries and parameters counted on the meta device."""

        def __init__(self, layers: list[LayerSpec], *, stage_parts: list[int] | None, **kwargs: Any) -> None:
            object.__setattr__(self, "_lnstrain_stage_parts", stage_parts)  # read during super().__init__
            super().__init__(layers, **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            if self._lnstrain_stage_parts is None:
                return super()._partition_layers(method)
            self.parts = list(self._lnstrain_stage_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

        def _count_layer_params(self) -> list[int]:
            with torch.device("meta"):
                return super()._count_layer_params()

    return LnsPipelineModule


# --- the JSON config --------------------------------------------------------------------------------
def deepspeed_json_refusal(ds_json: Mapping[str, Any]) -> str | None:
    """Why DeepSpeed's own config parser (``DeepSpeedConfig``, without process groups: one data-parallel
    rank) refuses ``ds_json``, in one line; None when it accepts it. DeepSpeed's INFO log (its world
    size) is silenced while it parses."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as deepspeed_logger

    level = deepspeed_logger.level
    deepspeed_logger.setLevel("WARNING")
    try:
        DeepSpeedConfig(dict(ds_json))
    except Exception as error:  # noqa: BLE001 - whatever DeepSpeed raises, it refuses this config
        return _one_line(error)
    finally:
        deepspeed_logger.setLevel(level)
    return None


# DeepSpeed's pydantic models -> the JSON section each reads
_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16", "DeepSpeedBF16Config": "bf16"}


def _one_line(error: Exception) -> str:
    """A pydantic ValidationError as ``deepspeed.section.key: message; ...``; anything else as its first line."""
    if hasattr(error, "errors") and hasattr(error, "title"):
        section = _SECTIONS.get(error.title, error.title)
        return "; ".join(f"deepspeed.{section}.{'.'.join(map(str, entry['loc']))}: {entry['msg']}"
                         for entry in error.errors())
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# --- the engine --------------------------------------------------------------------------------------
def call_before_pipeline_optimizer_step(pipe_engine: DeepSpeedEngine, callback: Callable[[], None]) -> None:
    """Make ``pipe_engine`` (a ``PipelineEngine``) call ``callback()`` once the gradients are reduced,
    right before each optimizer step it runs inside ``train_batch``: an instance-level override of
    DeepSpeed's instruction table, which the engine looks up on itself."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep

    table = type(pipe_engine)._INSTRUCTION_MAP
    pipe_step = table[OptimizerStep]

    def optimizer_step(engine: Any, **kwargs: Any) -> Any:
        callback()
        return pipe_step(engine, **kwargs)

    pipe_engine._INSTRUCTION_MAP = {**table, OptimizerStep: optimizer_step}


def checkpoint_file_io(engine: DeepSpeedEngine) -> CheckpointFileIO:
    return engine.checkpoint_engine


def load_checkpoint_files(engine: DeepSpeedEngine, checkpoint_dir: str, tag: str) -> dict[str, Any] | None:
    """``engine.load_checkpoint`` of weights, optimizer and schedule: the ``client_state`` the save
    stored, or None when nothing was found.

    DeepSpeed 0.19's ``BF16_Optimizer`` at ZeRO 0 (bf16 with pipeline stages) saves its state (fp32
    masters, Adam moments) in per-rank partition files but, with ZeRO off, reads it back from the
    model file, where it is one dict that its loader indexes by data-parallel rank (KeyError: 0). For
    it the optimizer is read from the partition files, as DeepSpeed does at ZeRO 1 (the engine's
    private ``_load_zero_checkpoint``).
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    in_partition_files = isinstance(engine.optimizer, BF16_Optimizer) and not engine.zero_optimization()
    load_path, client_state = engine.load_checkpoint(checkpoint_dir, tag=tag,
                                                     load_optimizer_states=not in_partition_files,
                                                     load_lr_scheduler_states=True)
    if load_path is not None and in_partition_files:
        engine._load_zero_checkpoint(checkpoint_dir, tag, load_optimizer_states=True)
    return None if load_path is None else dict(client_state or {})


def restore_step_counters(engine: DeepSpeedEngine, counters: Mapping[str, int]) -> None:
    """Set the engine's step counters (names in ``STEP_COUNTERS``) as a checkpoint recorded them."""
    unknown = sorted(set(counters) - set(STEP_COUNTERS))
    if unknown:
        raise ValueError(f"not DeepSpeed engine step counters: {unknown} (known: {STEP_COUNTERS})")
    for name, value in counters.items():
        setattr(engine, name, value)


def model_parallel_group(engine: DeepSpeedEngine) -> Any:
    """The process group of one data-parallel replica's model shards (tensor and pipeline ranks) as
    the engine sees it, or None when the engine has no model parallelism."""
    mpu = getattr(engine, "mpu", None)
    return mpu.get_model_parallel_group() if mpu is not None else None


# --- optimizers --------------------------------------------------------------------------------------
def base_optimizer(deepspeed_optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed's ZeRO/bf16/fp16 wrapper steps (the optimizer itself unwrapped)."""
    return getattr(deepspeed_optimizer, "optimizer", deepspeed_optimizer)


def fp16_loss_scale(deepspeed_optimizer: Any) -> float | None:
    """The fp16 loss scale the wrapper's next backward uses, None when it holds none."""
    scale = getattr(deepspeed_optimizer, "cur_scale", None) or getattr(deepspeed_optimizer, "loss_scale", None)
    return float(scale) if scale is not None else None


def relink_optimizer_state(deepspeed_optimizer: Any) -> None:
    """After the torch optimizer's state was replaced outside DeepSpeed: point the wrapper's
    per-parameter views (bf16 and ZeRO-1/2 fp32 fragments) at the new state tensors."""
    if hasattr(deepspeed_optimizer, "_lazy_init_hp_params_optimizer_state"):
        deepspeed_optimizer._hp_optimizer_states_linked = False
        deepspeed_optimizer._lazy_init_hp_params_optimizer_state()


# --- parameters --------------------------------------------------------------------------------------
def has_fp32_fragment(param: torch.nn.Parameter) -> bool:
    """Whether a DeepSpeed wrapper keeps this parameter's fp32 master and optimizer state in its
    flat partitions (set them with ``set_full_fp32_param``/``set_full_optimizer_state``)."""
    return hasattr(param, "_hp_mapping")


def local_partition(param: torch.nn.Parameter) -> torch.Tensor:
    """The part of ``param`` this rank holds: ZeRO-3's local partition, else the parameter itself."""
    return getattr(param, "ds_tensor", param)


def full_gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's complete gradient (this tensor rank's shard). Under ZeRO and the bf16 optimizer
    it lives in partitions and is assembled with a collective over the data-parallel group, so every
    data-parallel rank must ask for it."""
    if param.grad is not None and getattr(param, "_hp_grad", None) is None:
        return param.grad
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param

    safe_set_full_fp32_param(param, value)


def set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    safe_set_full_optimizer_state(param, value, key)


# --- checkpoint files --------------------------------------------------------------------------------
def torch_save_zip_format(file_io: CheckpointFileIO) -> bool | None:
    """``torch.save``'s ``_use_new_zipfile_serialization`` when ``file_io`` is DeepSpeed's torch
    checkpoint engine (each file one ``torch.save`` to its path); None for any other engine."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(file_io) is not TorchCheckpointEngine:
        return None
    return file_io.zipfile_serialization


RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""What DeepSpeed's ZeRO saves copy into the checkpoint directory (``_copy_recovery_script``)."""


def write_recovery_scripts_fresh(engine: DeepSpeedEngine, write_fresh: Callable[[str, bytes], None]) -> None:
    """Make ``engine``'s ZeRO saves write DeepSpeed's recovery scripts through ``write_fresh(path,
    data)`` (a new executable file renamed into place) instead of DeepSpeed's ``copyfile`` and
    ``chmod`` of the path, which write through a link planted under that name and make its target
    executable."""
    import deepspeed

    source = os.path.join(os.path.dirname(deepspeed.__file__), "utils")

    def copy_recovery_scripts(save_path: str) -> None:
        for script in RECOVERY_SCRIPTS:
            with open(os.path.join(source, script), "rb") as handle:
                write_fresh(os.path.join(save_path, script), handle.read())

    engine._copy_recovery_script = copy_recovery_scripts


def pickled_record_classes() -> list[type]:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and plain values."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler]


class _TorchWithLoad(types.ModuleType):
    """``torch`` as one module sees it, with another ``load``."""

    def __init__(self, name: str, load: Callable[..., Any]) -> None:
        super().__init__(name)
        self.load = load

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def zero3_fp32_state_dict(step_dir: str | os.PathLike,
                          load: Callable[[Any, Any], Any]) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32`` reader of a ZeRO-3 checkpoint, reading every file with
    ``load(path, map_location)`` instead of its own ``torch.load(..., weights_only=False)``."""
    from deepspeed.utils import zero_to_fp32

    step_dir = os.fspath(step_dir)

    def replaced_load(path: Any, map_location: Any = None, mmap: bool | None = None, **_: Any) -> Any:
        return load(path, map_location)

    original = zero_to_fp32.torch
    zero_to_fp32.torch = _TorchWithLoad("torch", replaced_load)
    try:
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(step_dir),
                                                                     tag=os.path.basename(step_dir))
    finally:
        zero_to_fp32.torch = original
