"""Resume a checkpoint saved at one (tensor, pipeline, data) layout in another one.

Why our own converter rather than DeepSpeed's universal checkpoint: ``ds_to_universal`` merges
tensor shards with a few fixed patterns (concatenate along a dim, replicate) and keys parameters by
the module's names. Our fused QKV weight is a stack of per-part shards (with KV heads replicated
when there are fewer than ranks), our vocabulary is padded per tensor size, and the same weight is
``layers.2.attention.qkv_proj.weight`` at pipeline size 1 but ``3.attention.qkv_proj.weight`` in a
pipeline, so the universal format would need per-parameter patterns and name maps that we already
have in the layers' ``shard``/``unshard`` and ``param_names``.

What carries over: fp32 master weights, Adam's ``exp_avg``/``exp_avg_sq`` and step count (from
ZeRO-1/2 checkpoints; a ZeRO-0 or ZeRO-3 source gives weights only, and ``load_resharded`` then
refuses unless ``require_optimizer_state=False``), the learning-rate schedule, DeepSpeed's step
counters and lnstrain's data position (consumed samples, so the new data-parallel size reads the
same next batch). Not carried: RNG states (dropout masks differ from the uninterrupted run), fp16
loss-scaler state. Every rank reads the whole checkpoint (CPU memory: full model + 2 moments).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lnstrain.checkpoint.layouts import MOMENT_KEYS, FullState, read_full_state, read_saved_layout
from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.manager import TrainingPosition, position_problems
from lnstrain.checkpoint.metadata import read_metadata
from lnstrain.checkpoint.sharding import check_full_state_dict, local_shards
from lnstrain.checkpoint.verifier import Trust
from lnstrain.deepspeed_adapter import has_fp32_fragment, set_full_fp32_param, set_full_optimizer_state

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

logger = logging.getLogger(__name__)


def needs_resharding(step_dir: str | Path, layout: tuple[int, int, int]) -> bool:
    """Whether a checkpoint's (tensor, pipeline, data) layout differs from ``layout``."""
    saved = read_saved_layout(step_dir)
    return (saved.tensor, saved.pipeline, saved.data) != tuple(layout)


def reshard_problems(step_dir: str | Path, layout: tuple[int, int, int], fresh_optimizer_ok: bool) -> list[str]:
    """Why ``step_dir`` cannot resume at ``layout`` (tensor, pipeline, data); empty when it can.

    Only ZeRO-1/2 checkpoints give back the Adam moments at another layout."""
    saved = read_saved_layout(step_dir)
    if (saved.tensor, saved.pipeline, saved.data) == tuple(layout) or saved.zero_stage in (1, 2) or fresh_optimizer_ok:
        return []
    return [f"{step_dir} was saved at (tensor, pipeline, data) = ({saved.tensor}, {saved.pipeline}, {saved.data}) "
            f"with ZeRO-{saved.zero_stage}, whose Adam moments cannot be resharded to this run's {tuple(layout)}; "
            "resume at the saved layout, or set checkpoint.reshard_with_fresh_optimizer: true to continue with "
            "the weights, schedule and data position and fresh optimizer moments"]


def _prime_optimizer_state(base: torch.optim.Optimizer, step: int) -> None:
    """Give every flat (or plain) parameter of the torch optimizer Adam state at ``step``, so that
    DeepSpeed's per-parameter views of the moments exist before the first step (relink them after)."""
    for group in base.param_groups:
        # torch's own rule: fused and capturable kernels read the step on the parameter's device
        # (fused CUDA AdamW refuses a CPU step), the others keep it on the CPU.
        step_on_param_device = bool(group.get("fused") or group.get("capturable"))
        for flat in group["params"]:
            state = base.state[flat]
            state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=flat.device if step_on_param_device else "cpu")
            for key in MOMENT_KEYS:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)


def apply_full_state(engine: TrainingEngine, state: FullState, require_optimizer_state: bool = True,
                     source: str = "checkpoint") -> None:
    """Load full weights (and moments) into this rank's engine, whatever its layout."""
    module = engine.module
    check_full_state_dict(state.weights, engine.config.model, source)
    carry_moments = bool(state.moments) and state.optimizer_step is not None
    if require_optimizer_state and not carry_moments:
        raise ValueError(f"{source} has no Adam moments this reader can recover (ZeRO-0 or ZeRO-3 source); "
                         "resume with weights only by passing require_optimizer_state=False")
    base = engine.base_optimizer
    if carry_moments:
        _prime_optimizer_state(base, state.optimizer_step)
        engine.relink_optimizer_state()
    moments = ({key: {name: shard for name, _, shard in local_shards(module, state.moments[key])}
                for key in MOMENT_KEYS} if carry_moments else {})
    with torch.no_grad():
        for name, param, shard in local_shards(module, state.weights):
            param.copy_(shard.to(param.dtype))
            set_full_fp32_param(param, shard)
            for key in moments:
                value = moments[key][name]
                if has_fp32_fragment(param):
                    set_full_optimizer_state(param, value, key)
                elif param in base.state:  # no ZeRO wrapper: the torch optimizer holds the parameter
                    base.state[param][key].copy_(value)


def load_resharded(training_engine: TrainingEngine, step_dir: str | Path, require_optimizer_state: bool = True,
                   allow_pickle: bool = False) -> TrainingPosition:
    """Restore ``step_dir`` (saved at any layout) into ``training_engine`` (at this run's layout):
    weights, optimizer, schedule, step counters; returns the data position.

    Collective only in the sense that every rank calls it; it communicates nothing. ``allow_pickle``:
    the checkpoint is trusted (``lnstrain.checkpoint.safe_load``).
    """
    step_dir = Path(step_dir)
    config = training_engine.config
    state = read_full_state(step_dir, config, allow_pickle=allow_pickle)
    meta = read_metadata(step_dir)
    disagreements = position_problems(meta, state.saved_position, step_dir)
    if disagreements:  # every rank read the same files: every rank raises this
        raise CheckpointError("cannot resume:\n  - " + "\n  - ".join(disagreements), agreed=True)
    apply_full_state(training_engine, state, require_optimizer_state, str(step_dir))
    if state.scheduler_state is not None:
        scheduler = training_engine.scheduler
        scheduler.load_state_dict(state.scheduler_state)
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr  # what the next step uses; the schedule moves it only after that step
    training_engine.restore_step_counters(state.engine_counters)
    logger.info("resharded %s (tensor %d, pipeline %d, data %d) into tensor %d, pipeline %d, data %d: "
                "step %d, %d samples consumed, %s, optimizer moments %s", step_dir, meta.tensor_parallel,
                meta.pipeline_parallel, meta.data_parallel, training_engine.groups.tp_size,
                training_engine.groups.pp_size, training_engine.groups.dcp_size, meta.step, meta.consumed_samples,
                state.weights_source, "carried" if state.moments else "NOT carried")
    return TrainingPosition.from_metadata(meta)


def initialize_from(training_engine: TrainingEngine, path: str | Path, unfold_lns: bool | None = None,
                    trust: Trust = Trust()) -> None:
    """``checkpoint.init_from``: this rank's shards of the weights at ``path`` (a consolidated file, a
    Hugging Face LLaMA directory or an lnstrain checkpoint of any layout) into the live engine, fp32
    masters included; the optimizer, schedule and data position start fresh (continued pretraining).
    ``unfold_lns``: ``checkpoint.init_from_unfold_lns`` (None: as a Hugging Face export's config.json says);
    ``trust``: the run's opt-ins and key, for an lnstrain checkpoint (``verifier``)."""
    from lnstrain.checkpoint.consolidated_file import load_init_state_dict

    state = FullState(weights=load_init_state_dict(path, training_engine.config.model, unfold_lns, trust))
    apply_full_state(training_engine, state, require_optimizer_state=False, source=str(path))
    logger.info("initialised the model from %s", path)
