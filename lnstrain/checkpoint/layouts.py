"""Read a DeepSpeed checkpoint of any (tensor, pipeline, data) layout as the single-process model.

Files in a ``global_step<N>/`` directory (DeepSpeed 0.19; "mp rank" m = pp_rank * tp + tp_rank)::

    mp_rank_{m}_model_states.pt                pp = 1: the module's shards ('module'); always: param_shapes
                                               (the order of ZeRO's flat groups), schedule, step counters
    layer_{i}-model_{t}-model_states.pt        pp > 1: pipeline entry i's shard on tensor rank t
    zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt
                                               ZeRO-1/2: data rank d's slice of the flat fp32 master
                                               weights and Adam moments of every parameter group
    bf16_zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt   the same, written by DeepSpeed's bf16 optimizer

``read_full_state`` turns them into full fp32 tensors named as the single-process ``Transformer``
(``param_names``): flat ZeRO slices are concatenated over data ranks and cut along ``param_shapes``,
tensor shards are joined with the layers' own ``unshard``, pipeline positions are mapped back to
``layers.{ℓ-1}`` through the layer numbers. fp32 master weights are preferred to the module's
(bf16 or fp16) weights when present. ZeRO-3 checkpoints go through DeepSpeed's ``zero_to_fp32``
(weights only, tensor and pipeline size 1); ZeRO-3 writes its module states per data rank
(``zero_pp_rank_{d}_mp_rank_{m}_model_states.pt``) instead of ``mp_rank_{m}_model_states.pt``, so
the schedule and step counters are read from whichever of the two the checkpoint has.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lnstrain.checkpoint.deepspeed_files import OPTIMIZER_PARTITION
from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.manager import CLIENT_STATE_KEY
from lnstrain.checkpoint.metadata import CONFIG_FILE, METADATA_FILE, read_metadata, saved_config_data
from lnstrain.checkpoint.param_names import (fit_rows, is_vocab_sharded, owner_of, saved_pipeline_name_mapper,
                                             single_process_shapes, tensor_parallel_template)
from lnstrain.checkpoint.safe_load import load_deepspeed_file, zero3_fp32_weights
from lnstrain.checkpoint.verifier import Trust, open_checkpoint
from lnstrain.config.run_config import Config, config_from_dict
from lnstrain.report_lines import escaped

logger = logging.getLogger(__name__)

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class SavedLayout:
    """How a checkpoint was sharded."""

    tensor: int
    pipeline: int
    data: int
    zero_stage: int


@dataclass
class FullState:
    """Everything a checkpoint holds, as the single-process model sees it (fp32, full tensors)."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """``exp_avg`` / ``exp_avg_sq`` -> canonical name -> full tensor; empty when not recoverable."""
    optimizer_step: int | None = None
    scheduler_state: dict | None = None
    engine_counters: dict[str, int] = field(default_factory=dict)
    """DeepSpeed's ``global_steps``, ``global_samples``, ``skipped_steps``."""
    weights_source: str = ""
    saved_position: dict | None = None
    """The training position the save gave DeepSpeed (``manager.CLIENT_STATE_KEY``), when recorded."""


# --- the step directory and its config -------------------------------------------------------------
def resolve_step_dir(path: str | os.PathLike, trust: Trust | None = None) -> Path:
    """A ``global_step<N>`` directory, a checkpoint directory or a run directory -> the step directory
    to read, verified (``verifier.open_checkpoint``: the one a resume would choose, under ``trust``; no
    opt-ins when None). Raises ``CheckpointError`` (a ``ValueError``) saying why none may be read."""
    return open_checkpoint(path, trust or Trust())


def read_step_config(step_dir: str | os.PathLike) -> Config:
    """The resolved run config saved in the step directory (a verified one: ``verifier``). It is the
    config as resolved, so a ``base:`` in it, which would read another file, is refused."""
    path = Path(step_dir) / CONFIG_FILE
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} is missing: not an lnstrain checkpoint (no resolved config)")
    try:
        return config_from_dict(saved_config_data(path), source=str(path))
    except (OSError, ValueError) as error:  # the verifier refuses such a config first; a reader never raises more
        raise CheckpointError(f"cannot read {path}: {escaped(str(error))}") from None


def read_saved_layout(step_dir: str | os.PathLike, allow_pickle: bool = False) -> SavedLayout:
    step_dir = Path(step_dir)
    if (step_dir / METADATA_FILE).is_file():
        meta = read_metadata(step_dir)
        return SavedLayout(meta.tensor_parallel, meta.pipeline_parallel, meta.data_parallel, meta.zero_stage)
    states = load_deepspeed_file(model_states_file(step_dir), allow_pickle)
    dims = states.get("checkpoint_parallel_dimensions", {})
    return SavedLayout(dims.get("tp_degree", 1), dims.get("pp_degree", 1), states["dp_world_size"],
                       states["ds_config"].get("zero_optimization", {}).get("stage", 0))


def model_states_file(step_dir: str | os.PathLike) -> Path:
    """The file holding the schedule and step counters: ``mp_rank_00_model_states.pt``, or ZeRO-3's
    ``zero_pp_rank_0_mp_rank_00_model_states.pt``."""
    step_dir = Path(step_dir)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (step_dir / name).is_file():
            return step_dir / name
    raise FileNotFoundError(f"{step_dir} has neither mp_rank_00_model_states.pt nor ZeRO-3's "
                            "zero_pp_rank_0_mp_rank_00_model_states.pt: not a DeepSpeed checkpoint")


# --- per tensor rank: local tensors under their saved names ----------------------------------------
def _module_weights(step_dir: Path, layout: SavedLayout, allow_pickle: bool) -> list[dict[str, torch.Tensor]]:
    """Per tensor rank: the module's saved weights (pipeline names when pp > 1)."""
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.tensor)]
    if layout.pipeline == 1:
        for t in range(layout.tensor):
            module = load_deepspeed_file(step_dir / f"mp_rank_{t:02d}_model_states.pt", allow_pickle)["module"]
            per_rank[t] = {k.removeprefix("module."): v for k, v in module.items()}
        return per_rank
    for path in sorted(step_dir.glob("layer_*-model_*-model_states.pt")):
        index, t = (int(x) for x in re.findall(r"\d+", path.name)[:2])
        for key, tensor in load_deepspeed_file(path, allow_pickle).items():
            per_rank[t][f"{index}.{key}"] = tensor
    return per_rank


def _unflatten(flat: torch.Tensor, shapes: dict[str, torch.Size], paddings: list[int] | None) -> dict[str, torch.Tensor]:
    """Cut one parameter group's flat vector (all data ranks' slices joined) into its parameters."""
    out, offset = {}, 0
    for index, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        out[name] = flat.narrow(0, offset, numel).view(shape).clone()
        offset += numel + (paddings[index] if paddings else 0)
    if offset > flat.numel():
        raise ValueError(f"ZeRO flat group holds {flat.numel()} values but its parameters need {offset}")
    return out


def _zero_partitions(step_dir: Path, layout: SavedLayout, allow_pickle: bool
                     ) -> tuple[list[dict[str, dict[str, torch.Tensor]]], int | None]:
    """Per tensor rank: {"weight"|"exp_avg"|"exp_avg_sq": {saved name: tensor}} from ZeRO-1/2 files."""
    files: dict[int, dict[int, Path]] = defaultdict(dict)
    for path in step_dir.iterdir():
        match = OPTIMIZER_PARTITION.fullmatch(path.name)
        if match:
            files[int(match.group(3))][int(match.group(2))] = path
    per_rank: list[dict[str, dict[str, torch.Tensor]]] = [defaultdict(dict) for _ in range(layout.tensor)]
    step = None
    for mp_rank, by_data_rank in sorted(files.items()):
        if sorted(by_data_rank) != list(range(layout.data)):
            raise FileNotFoundError(f"{step_dir}: ZeRO files of mp rank {mp_rank} cover data ranks "
                                    f"{sorted(by_data_rank)}, expected 0..{layout.data - 1}")
        shapes = load_deepspeed_file(step_dir / f"mp_rank_{mp_rank:02d}_model_states.pt", allow_pickle)["param_shapes"]
        slices = [load_deepspeed_file(by_data_rank[d], allow_pickle)["optimizer_state_dict"] for d in range(layout.data)]
        paddings = slices[0].get("param_alignment_paddings")
        fp32_key = "single_partition_of_fp32_groups" if "single_partition_of_fp32_groups" in slices[0] else "fp32_groups"
        target = per_rank[mp_rank % layout.tensor]
        for group, group_shapes in enumerate(shapes):
            group_paddings = paddings[group] if paddings else None
            flat = torch.cat([s[fp32_key][group].float() for s in slices])
            target["weight"].update(_unflatten(flat, group_shapes, group_paddings))
            states = [s["base_optimizer_state"]["state"].get(group, {}) for s in slices]
            if all(all(k in st for k in MOMENT_KEYS) for st in states):
                for key in MOMENT_KEYS:
                    target[key].update(_unflatten(torch.cat([st[key].float() for st in states]), group_shapes,
                                                  group_paddings))
                step = int(states[0]["step"])
    return per_rank, step


def _zero3_weights(step_dir: Path, layout: SavedLayout, allow_pickle: bool) -> list[dict[str, torch.Tensor]]:
    if layout.tensor > 1 or layout.pipeline > 1:
        raise NotImplementedError(f"{step_dir}: ZeRO-3 checkpoints are read only at tensor and pipeline size 1")
    weights = zero3_fp32_weights(step_dir, allow_pickle)  # DeepSpeed's reader, loading safely
    return [{k.removeprefix("module."): v.float() for k, v in weights.items()}]


# --- joining tensor shards --------------------------------------------------------------------------
def _join(per_rank: list[dict[str, torch.Tensor]], config: Config, layout: SavedLayout, what: str) -> dict[str, torch.Tensor]:
    """Canonical full tensors from every tensor rank's saved tensors."""
    cfg = config.model
    rename = saved_pipeline_name_mapper(cfg) if layout.pipeline > 1 else (lambda name: name)
    template = tensor_parallel_template(cfg, layout.tensor)
    expected = single_process_shapes(cfg)
    renamed = [{rename(name): tensor for name, tensor in local.items()} for local in per_rank]
    full = {}
    for name in renamed[0]:
        shards = [local.get(name) for local in renamed]
        if any(s is None for s in shards):
            raise ValueError(f"{what}: {name} is missing on some tensor ranks of the checkpoint")
        owner = owner_of(template, name)
        tensor = owner.unshard(shards) if hasattr(owner, "unshard") else shards[0]
        if is_vocab_sharded(owner) and name in expected:
            tensor = fit_rows(tensor, expected[name][0])
        full[name] = tensor.float().contiguous()
    return full


def read_full_state(step_dir: str | os.PathLike, config: Config | None = None, with_optimizer: bool = True,
                    allow_pickle: bool = False) -> FullState:
    """The checkpoint in ``step_dir`` as full fp32 tensors (see the module docstring)."""
    step_dir = Path(step_dir)
    config = config or read_step_config(step_dir)
    layout = read_saved_layout(step_dir, allow_pickle)
    states = load_deepspeed_file(model_states_file(step_dir), allow_pickle)
    result = FullState(weights={}, scheduler_state=states.get("lr_scheduler"), saved_position=states.get(CLIENT_STATE_KEY),
                       engine_counters={k: int(states.get(k) or 0) for k in ("global_steps", "global_samples",
                                                                             "skipped_steps")})
    if layout.zero_stage == 3:
        result.weights = _join(_zero3_weights(step_dir, layout, allow_pickle), config, layout, str(step_dir))
        result.weights_source = "ZeRO-3 fp32 partitions (zero_to_fp32)"
        logger.warning("%s: ZeRO-3 optimizer moments are not read (weights only)", step_dir)
        return result
    zero, step = _zero_partitions(step_dir, layout, allow_pickle) if layout.zero_stage in (1, 2) or any(
        OPTIMIZER_PARTITION.fullmatch(p.name) for p in step_dir.iterdir()) else ([], None)
    if zero and zero[0].get("weight"):
        result.weights = _join([z["weight"] for z in zero], config, layout, str(step_dir))
        result.weights_source = "fp32 master weights (ZeRO partitions)"
    else:
        result.weights = _join(_module_weights(step_dir, layout, allow_pickle), config, layout, str(step_dir))
        result.weights_source = "module weights"
    if with_optimizer and zero and all(zero[0].get(k) for k in MOMENT_KEYS):
        result.moments = {k: _join([z[k] for z in zero], config, layout, str(step_dir)) for k in MOMENT_KEYS}
        result.optimizer_step = step
    elif with_optimizer:
        logger.warning("%s: no Adam moments found (ZeRO stage %d): only weights are read", step_dir, layout.zero_stage)
    return result


def load_consolidated_state_dict(path: str | os.PathLike, trust: Trust = Trust()
                                 ) -> tuple[Config, dict[str, torch.Tensor]]:
    """(resolved run config, single-process fp32 state dict) of the checkpoint at ``path`` (run,
    checkpoint or step directory; the one ``verifier.open_checkpoint`` chooses), any layout. Raises
    ``CheckpointError`` when no checkpoint there verifies under ``trust``."""
    step_dir = resolve_step_dir(path, trust)
    config = read_step_config(step_dir)
    return config, read_full_state(step_dir, config, with_optimizer=False, allow_pickle=trust.allow_pickle).weights


def describe(state: FullState) -> dict[str, Any]:
    """A short summary for logs and tools."""
    return {"parameters": sum(t.numel() for t in state.weights.values()), "weights_from": state.weights_source,
            "optimizer_moments": bool(state.moments), "optimizer_step": state.optimizer_step}
