"""Single-file state dicts (safetensors with the run config in its metadata), and what a run's
``checkpoint.init_from`` may name.

``load_init_state_dict(path, model_cfg)`` accepts:
  * a ``.safetensors`` file (``tools/consolidate_checkpoint.py`` or ``tools/convert_from_hf.py`` output),
  * a ``.pt`` state dict (loaded with ``weights_only=True``),
  * a Hugging Face LLaMA directory (has ``config.json``),
  * an lnstrain run, checkpoint or ``global_step<N>`` directory of any layout,
and returns the single-process fp32 state dict, checked against ``model_cfg``; then
``sharding.apply_full_state_dict(module, state, groups, model_cfg)`` puts it into any layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from lnstrain.checkpoint.safe_load import load_tensors
from lnstrain.checkpoint.safetensors_io import save_safetensors
from lnstrain.checkpoint.sharding import check_full_state_dict
from lnstrain.checkpoint.verifier import Trust
from lnstrain.config.run_config import Config, config_from_dict
from lnstrain.model.config import ModelConfig

CONFIG_METADATA_KEY = "lnstrain_config"


def save_consolidated(path: str | os.PathLike, state: dict[str, torch.Tensor], config: Config | None = None) -> Path:
    """Write a state dict as one safetensors file, with ``config`` (YAML) in its metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}
    if config is not None:
        metadata[CONFIG_METADATA_KEY] = config.to_yaml()
    save_safetensors({name: tensor.contiguous() for name, tensor in state.items()}, path, metadata)
    return path


def load_consolidated(path: str | os.PathLike) -> tuple[Config | None, dict[str, torch.Tensor]]:
    """(the config stored with it, or None; the state dict) of a file ``save_consolidated`` wrote."""
    with safe_open(str(path), framework="pt") as handle:
        text = (handle.metadata() or {}).get(CONFIG_METADATA_KEY)
    config = config_from_dict(yaml.safe_load(text), source=f"{path} metadata") if text else None
    return config, load_file(str(path))


def load_init_state_dict(path: str | os.PathLike, model_cfg: ModelConfig, unfold_lns: bool | None = None,
                         trust: Trust = Trust()) -> dict[str, torch.Tensor]:
    """The single-process state dict that ``checkpoint.init_from`` names (see the module docstring).
    ``unfold_lns`` is for a Hugging Face directory (``hf_io.load_hf_llama_state_dict``); an lnstrain
    checkpoint is the one ``verifier.open_checkpoint`` chooses under ``trust`` (the run's opt-ins and key)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        state = load_consolidated(path)[1]
    elif path.is_file():
        state = load_tensors(path)
    elif (path / "config.json").is_file():
        from lnstrain.checkpoint.hf_io import load_hf_llama_state_dict

        state = load_hf_llama_state_dict(path, model_cfg, unfold_lns)
    elif path.is_dir():
        from lnstrain.checkpoint.layouts import load_consolidated_state_dict

        state = load_consolidated_state_dict(path, trust)[1]
    else:
        raise FileNotFoundError(f"checkpoint.init_from: {path} does not exist")
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"checkpoint.init_from: {path} is not a state dict (a mapping of names to tensors)")
    check_full_state_dict(state, model_cfg, str(path))
    return {name: tensor.float() for name, tensor in state.items()}
