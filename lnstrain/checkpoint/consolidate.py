"""One fp32 state dict of the single-process ``Transformer`` from a sharded training checkpoint.

Supported now: tensor_parallel = pipeline_parallel = 1 with any ZeRO stage and data-parallel size.
With ZeRO 1-3 the fp32 master weights are gathered from the optimizer shards (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``); with ZeRO 0 they are the module weights, exact in
fp32 and widened from bf16/fp16 otherwise. Other layouts raise ``NotImplementedError`` naming them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import yaml

from lnstrain.checkpoint.manager import newest_checkpoint
from lnstrain.checkpoint.metadata import CONFIG_FILE, is_complete, read_metadata, step_of
from lnstrain.config.run_config import Config, config_from_dict

logger = logging.getLogger(__name__)

_MODEL_STATES = "mp_rank_00_model_states.pt"


def resolve_step_dir(checkpoint_path: str | Path) -> Path:
    """A complete ``global_step<N>`` directory from itself or from a checkpoint directory."""
    path = Path(checkpoint_path)
    if step_of(path) is None:
        found = newest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path} holds no complete global_step<N> checkpoint")
        path = found
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete lnstrain checkpoint (interrupted save or wrong path)")
    return path


def load_checkpoint_config(step_dir: Path) -> Config:
    with open(step_dir / CONFIG_FILE, encoding="utf-8") as handle:
        return config_from_dict(yaml.safe_load(handle), source=str(step_dir / CONFIG_FILE))


def _module_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    # DeepSpeed's own file (it pickles its config objects, so weights_only cannot read it); it is
    # the checkpoint the caller chose to load, not ours to vet.
    states = torch.load(step_dir / _MODEL_STATES, map_location="cpu", weights_only=False)
    return {name: tensor.float() for name, tensor in states["module"].items()}


def load_consolidated_state_dict(checkpoint_path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """(the run's config, fp32 state dict with ``Transformer``'s parameter names) of a checkpoint.

    ``checkpoint_path``: a ``global_step<N>`` directory, or a checkpoint directory (its newest
    complete checkpoint is used).
    """
    step_dir = resolve_step_dir(checkpoint_path)
    metadata = read_metadata(step_dir)
    if metadata.tensor_parallel != 1 or metadata.pipeline_parallel != 1:
        raise NotImplementedError(
            f"{step_dir}: consolidating a checkpoint saved with tensor_parallel={metadata.tensor_parallel}, "
            f"pipeline_parallel={metadata.pipeline_parallel} is not implemented yet (supported: "
            "tensor_parallel=1, pipeline_parallel=1 with any ZeRO stage)")
    config = load_checkpoint_config(step_dir)
    if metadata.zero_stage == 0:
        if metadata.precision != "fp32":
            logger.warning("%s: ZeRO-0 %s checkpoint: the weights are widened from %s, not fp32 masters",
                           step_dir, metadata.precision, metadata.precision)
        state = _module_weights(step_dir)
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
        state = {name: tensor.float() for name, tensor in state.items()}
    return config, state
