"""``checkpoint.init_from`` checked before anything starts, from headers and small files only: the
weights it names can be read and have this model's names and shapes, and a Hugging Face export's
config.json (with lnstrain's LNS record) is sound. Loading (``consolidated_file.load_init_state_dict``)
checks everything again, after process groups exist; this finds the same problems minutes earlier.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.param_names import single_process_shapes
from lnstrain.checkpoint.sharding import check_full_state_dict
from lnstrain.model.config import ModelConfig

if TYPE_CHECKING:
    from lnstrain.checkpoint.verifier import Trust

KEY = "checkpoint.init_from"


def init_from_problems(path: str, model_cfg: ModelConfig, unfold_lns: bool | None,
                       trust: Trust | None = None) -> list[str]:
    """Every problem with the weights ``path`` names (a missing path is ``CheckpointConfig.validate``'s);
    an lnstrain checkpoint must verify under ``trust`` (the run's opt-ins and key)."""
    path_ = Path(path)
    if not path_.exists():
        return []
    try:
        if path_.is_file() and path_.suffix == ".safetensors":
            return _safetensors_problems(path_, model_cfg)
        if path_.is_file():
            if not zipfile.is_zipfile(path_):
                return [f"{KEY}: {path} is not a torch.save file (no zip archive); give a .safetensors or .pt "
                        "state dict, a Hugging Face LLaMA directory or an lnstrain checkpoint directory"]
            return []
        if (path_ / "config.json").is_file():
            return _hugging_face_problems(path_, model_cfg, unfold_lns)
        return _lnstrain_checkpoint_problems(path_, model_cfg, trust)
    except OSError as error:
        return [f"{KEY}: cannot read {path}: {error}"]


def _shape_problems(shapes: dict[str, tuple[int, ...]], model_cfg: ModelConfig, source: str) -> list[str]:
    """``check_full_state_dict`` on shapes alone (meta tensors: nothing is read or allocated)."""
    try:
        check_full_state_dict({name: torch.empty(shape, device="meta") for name, shape in shapes.items()},
                              model_cfg, source)
    except ValueError as error:  # StateDictMismatchError
        return [f"{KEY}: {error}"]
    return []


def _safetensors_problems(path: Path, model_cfg: ModelConfig) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        return [f"{KEY}: {path} is not a readable safetensors file ({error}); it may be truncated: write it again"]
    return _shape_problems(shapes, model_cfg, str(path))


def _hugging_face_problems(directory: Path, model_cfg: ModelConfig, unfold_lns: bool | None) -> list[str]:
    from lnstrain.checkpoint.hf_io import INDEX_FILE
    from lnstrain.checkpoint.hf_llama import config_problems
    from lnstrain.checkpoint.lns_fold import RECORD_KEY, record_problems

    config_path = directory / "config.json"
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return [f"{KEY}: {config_path} is not valid JSON ({error})"]
    if not isinstance(hf, dict):
        return [f"{KEY}: {config_path} holds {type(hf).__name__}, not a JSON object"]
    if hf.get("model_type", "llama") != "llama":
        return [f"{KEY}: {config_path}: model_type {hf.get('model_type')!r} is not 'llama'"]
    problems = [f"{KEY}: {directory}: {problem}" for problem in config_problems(hf, model_cfg)]
    problems += [f"{KEY}: {problem}" for problem in record_problems(hf.get(RECORD_KEY), model_cfg, unfold_lns,
                                                                     str(directory))]
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            return problems + [f"{KEY}: {index} is not a safetensors index ({type(error).__name__}: {error})"]
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            problems.append(f"{KEY}: {directory} lacks {', '.join(missing)}, which {INDEX_FILE} names")
    elif not (directory / "model.safetensors").is_file():
        problems.append(f"{KEY}: {directory} has no {INDEX_FILE} or model.safetensors (only safetensors "
                        "weights are read: they cannot carry code)")
    return problems


def _lnstrain_checkpoint_problems(path: Path, model_cfg: ModelConfig, trust: Trust | None) -> list[str]:
    from lnstrain.checkpoint.layouts import read_step_config
    from lnstrain.checkpoint.verifier import QUICK, Trust, open_checkpoint
    from lnstrain.config.loader import ConfigError

    try:
        step_dir = open_checkpoint(path, trust or Trust(), depth=QUICK)
        saved = read_step_config(step_dir).model
    except (CheckpointError, FileNotFoundError) as error:
        return [f"{KEY}: {error}"]
    except ConfigError as error:
        return [f"{KEY}: the config saved in {path} cannot be read: {'; '.join(error.problems)}"]
    return _shape_problems(single_process_shapes(saved), model_cfg, str(step_dir))
