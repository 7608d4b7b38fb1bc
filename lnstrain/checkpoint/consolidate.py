"""One fp32 state dict of the single-process ``Transformer`` from a sharded training checkpoint.

    load_consolidated_state_dict(checkpoint_path) -> (Config, dict[str, Tensor])

``checkpoint_path`` is a ``global_step<N>`` directory, a checkpoint directory (its newest complete
checkpoint) or a run directory. The reader for every (tensor, pipeline, data) layout lives in
``lnstrain.checkpoint.layouts``; this module is the stable name the analysis and export tools
import, and it reads ZeRO-3 checkpoints itself, because ZeRO-3 writes its model states per data
rank (``zero_pp_rank_<d>_mp_rank_00_model_states.pt``) instead of the ``mp_rank_00_model_states.pt``
that ``layouts.read_full_state`` opens first.
"""

from __future__ import annotations

import os

import torch

from lnstrain.checkpoint import layouts
from lnstrain.checkpoint.metadata import read_metadata
from lnstrain.config.run_config import Config


def _zero3_state_dict(step_dir) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
    return {name.removeprefix("module."): tensor.float() for name, tensor in weights.items()}


def load_consolidated_state_dict(checkpoint_path: str | os.PathLike) -> tuple[Config, dict[str, torch.Tensor]]:
    """(the run's resolved config, fp32 state dict with ``Transformer``'s parameter names)."""
    step_dir = layouts.resolve_step_dir(checkpoint_path)
    saved = read_metadata(step_dir)
    if saved.zero_stage == 3:
        if saved.tensor_parallel != 1 or saved.pipeline_parallel != 1:
            raise NotImplementedError(f"{step_dir}: ZeRO-3 checkpoints are read only with tensor_parallel=1 and "
                                      f"pipeline_parallel=1 (this one: {saved.tensor_parallel}, "
                                      f"{saved.pipeline_parallel})")
        return layouts.read_step_config(step_dir), _zero3_state_dict(step_dir)
    return layouts.load_consolidated_state_dict(step_dir)
