"""A single-process `Transformer` with a trained model's weights, for the depth analysis.

Two sources: a checkpoint of any parallel layout, through the checkpoint package's
`load_consolidated_state_dict(path) -> (Config, state_dict)` (run, checkpoint or global_step
directory); or a plain state-dict file
(`torch.save(model.state_dict())` of a single-process model) plus the run's YAML config.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from lnstrain.config.run_config import Config
from lnstrain.model import Transformer
from lnstrain.parallel.groups import ParallelGroups

logger = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _unwrap_state_dict(data: Any, source: str) -> dict[str, torch.Tensor]:
    """The parameter mapping inside a saved object: a state dict, or {"model"/"module": state dict}."""
    if isinstance(data, dict):
        for key in ("model", "module", "state_dict"):
            if isinstance(data.get(key), dict):
                data = data[key]
                break
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ValueError(f"{source}: not a state dict (a mapping of parameter names to tensors)")
    cleaned = {}
    for name, tensor in data.items():
        for prefix in _WRAPPER_PREFIXES:
            name = name.removeprefix(prefix)
        cleaned[name] = tensor
    return cleaned


def build_model(config: Config, state_dict: dict[str, torch.Tensor], source: str,
                device: str | torch.device = "cpu") -> Transformer:
    """A single-process fp32 `Transformer` of `config.model` holding `state_dict`, in eval mode."""
    problems = config.model.validate(1)
    if problems:
        raise ValueError(f"{source}: invalid model config:\n  " + "\n  ".join(problems))
    model = Transformer(config.model, ParallelGroups.single_process())
    state_dict = _unwrap_state_dict(state_dict, source)
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{source}: the weights do not fit the config's model shape ({e}); "
                         "is the config the one this model was trained with?") from e
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"{source}: parameter names do not match the config's model "
                         f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}); "
                         "is this a single-process state dict of the same model?")
    return model.to(device).eval()


def _consolidated_reader():
    """The checkpoint package's reader of every layout (tensor, pipeline, data, ZeRO 0-3)."""
    from lnstrain.checkpoint.layouts import load_consolidated_state_dict

    return load_consolidated_state_dict


def load_for_analysis(*, checkpoint: str | None = None, state_dict: str | None = None,
                      config: str | None = None, overrides: Sequence[str] = (),
                      device: str | torch.device = "cpu", trust: Any = None) -> tuple[Config, Transformer]:
    """(run config, model) from a checkpoint (the one ``lnstrain.checkpoint.verifier`` chooses under
    ``trust``, its ``Trust``; None: no opt-ins), or from a state-dict file and its YAML config."""
    if checkpoint is not None:
        run_config, weights = _consolidated_reader()(checkpoint, *([trust] if trust is not None else []))
        return run_config, build_model(run_config, weights, checkpoint, device)
    if state_dict is None or config is None:
        raise ValueError("give --checkpoint DIR, or both --state-dict FILE.pt and --config RUN.yaml")
    from lnstrain.config.run_config import load_config

    run_config = load_config(config, overrides, validate=False)
    weights = torch.load(state_dict, map_location="cpu", weights_only=True)
    return run_config, build_model(run_config, weights, state_dict, device)
