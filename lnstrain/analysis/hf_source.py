"""Hugging Face models as a depth-analysis source, read in place through transformers (no conversion).

    directory = inspect_hf_directory("models/Llama-2-7b-hf")     # config.json alone: family, context
    model = load_hf_model("models/Llama-2-7b-hf", dtype="bf16", device="cuda")   # or device_map="auto"
    analysis = analyze_model(model, batches)

Supported: the families of `hf_families.FAMILIES` (config.json's model_type). Everything that can be
known without the weights is checked first, from config.json and the file names alone: an
architecture outside the table, a directory without weights. transformers itself computes the model
(its attention, masks, rotary embeddings, soft-capping): the analysis only hooks the blocks
(`model_source.DepthModel`). Weights are read from local files only, never with remote code.

The norm scheme of a model is its family's norm placement (pre_ln, sandwich_ln, output_ln, post_ln),
or what an lnstrain export's config.json records (its "lnstrain" key): an LNS model exported with
`tools/convert_to_hf.py` is analysed as "lns", with the same figures as its checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lnstrain.analysis.hf_families import HFFamily, family_of
from lnstrain.analysis.model_source import DepthModel
from lnstrain.analysis.text_tokens import HFDocuments, import_transformers, load_hf_tokenizer
from lnstrain.checkpoint.lns_fold import RECORD_KEY

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a Hugging Face model directory (ValueError when it is not one)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path}: no config.json; --hf takes a local Hugging Face model directory "
                         "(config.json and the weights, as save_pretrained writes them)")
    try:
        return json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e


def is_hf_model_directory(path: str | Path) -> bool:
    """A directory holding a config.json with a model_type (lnstrain checkpoints have none)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    try:
        return "model_type" in read_hf_config(path)
    except ValueError:
        return False


@dataclass(frozen=True)
class HFModelDirectory:
    """What a model directory says about itself without its weights."""

    path: Path
    config: dict[str, Any]
    family: HFFamily
    vocab_size: int
    context: int
    """The model's context length (max_position_embeddings, or n_positions)."""

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def norm_scheme(self) -> str:
        """The family's placement, or the scheme an lnstrain export records."""
        record = self.config.get(RECORD_KEY) or {}
        return record.get("norm_scheme", self.family.placement.norm_scheme)


def safetensors_problems(path: Path) -> list[str]:
    """The safetensors files of a model directory (``model.safetensors`` or the shards its index names)
    whose headers cannot be read or that are missing: one line each. Headers only: no tensor is read."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return [f"{index}: not a safetensors index ({type(e).__name__}: {e})"]
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return []
    try:
        from safetensors import safe_open
    except ImportError:
        return []
    problems = []
    for shard in shards:
        if not (path / shard).is_file():
            problems.append(f"{path / shard}: missing (the index names it)")
            continue
        try:
            with safe_open(str(path / shard), framework="pt") as handle:
                handle.keys()
        except Exception as e:  # noqa: BLE001  (SafetensorError is not exported under one name everywhere)
            problems.append(f"{path / shard}: not a readable safetensors file ({' '.join(str(e).split())[:160]})")
    return problems


def inspect_hf_directory(path: str | Path) -> HFModelDirectory:
    """config.json read and checked, weights looked for and their safetensors headers read (no tensor);
    ValueError naming what is wrong."""
    path = Path(path)
    config = read_hf_config(path)
    family = family_of(path, config)
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{path}: no weights ({' or '.join(WEIGHT_FILES)})")
    problems = safetensors_problems(path)
    if problems:
        raise ValueError("; ".join(problems) + "; download or save the weights again")
    transformers = import_transformers()
    try:
        text_config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                              trust_remote_code=False).get_text_config()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}/config.json: transformers {transformers.__version__} cannot read it ({e})") from e
    return HFModelDirectory(path=path, config=config, family=family, vocab_size=text_config.vocab_size,
                            context=text_config.max_position_embeddings)


class HFDepthModel(DepthModel):
    """A transformers causal language model of a supported family."""

    def __init__(self, model: nn.Module, family: HFFamily, *, name: str, norm_scheme: str,
                 source: str = "Hugging Face", tokenizer: HFDocuments | None = None) -> None:
        self.module = model
        self.family = family
        self.name = name
        self.norm_scheme = norm_scheme
        self.norm_names = family.norm_roles
        self.source = source
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_seq_len = text_config.max_position_embeddings
        self._blocks = list(family.block_list(model))

    def layers(self) -> Sequence[nn.Module]:
        return self._blocks

    @property
    def input_device(self) -> torch.device:
        return self.module.get_input_embeddings().weight.device

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=tokens, use_cache=False).logits

    def norm_gains(self) -> list[list[float]]:
        """Mean |gain_offset + weight| of each block's norms, in `norm_names` order (an lnstrain LNS export
        has 1/sqrt(l) folded in); empty when a norm's weight is offloaded where it cannot be read."""
        gains = []
        for block in self._blocks:
            weights = [_readable_weight(getattr(block, attribute)) for _, attribute in self.family.norms]
            if any(weight is None for weight in weights):
                logger.warning("%s: norm weights offloaded out of reach; no norm gains in the report", self.name)
                return []
            gains.append([float((weight.detach().float() + self.family.gain_offset).abs().mean()) for weight in weights])
        return gains


def _readable_weight(module: nn.Module) -> torch.Tensor | None:
    """The module's weight; under a device_map that offloads it (to CPU or disk) the parameter is on the
    meta device and accelerate's hook on the module holds the values (its `weights_map`)."""
    if not module.weight.is_meta:
        return module.weight
    weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    return None if weights_map is None else weights_map["weight"]


def dtype_keyword(transformers) -> str:
    """The keyword from_pretrained takes the dtype as: `dtype` from transformers 4.56, `torch_dtype` before."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _layer_groups(names: list[str]) -> str:
    """``model.layers.2.* (9 tensors), lm_head.weight``: names grouped by the layer they belong to."""
    groups: dict[str, int] = {}
    for name in names:
        match = re.match(r"(.*?\.(?:layers|h|blocks|layer)\.\d+)\.", name)
        groups[f"{match.group(1)}.*" if match else name] = groups.get(f"{match.group(1)}.*" if match else name, 0) + 1
    return ", ".join(f"{group} ({count} tensors)" if count > 1 else group for group, count in groups.items())


def load_complete_pretrained(transformers: Any, path: Path, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` that never hands back a model with weights transformers
    made up: a weight missing from the files (a whole layer, say) or of another shape than config.json
    gives a ValueError naming them, as does a file transformers cannot read, instead of a model with
    freshly initialised tensors (and transformers' own table) or a traceback."""
    verbosity, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its table of missing keys: the error below says it in one line
    transformers.utils.logging.disable_progress_bar()
    logger.info("%s: reading the weights", path)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except (OSError, RuntimeError, ValueError, TypeError, KeyError, EOFError) as e:
        raise ValueError(f"{path}: transformers {transformers.__version__} cannot load the weights "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e
    except Exception as e:  # noqa: BLE001  (safetensors' own error type)
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"{path}: the weights cannot be read ({' '.join(str(e).split())[:300]})") from e
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    problems = []
    mismatched = [entry for entry in info.get("mismatched_keys") or []]
    if mismatched:
        problems.append("of another shape than config.json gives: " + ", ".join(
            f"{name} is {list(saved)} in the files, {list(wanted)} in the model" for name, saved, wanted, *_ in mismatched[:4])
            + (f" and {len(mismatched) - 4} more" if len(mismatched) > 4 else ""))
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        problems.append(f"missing from the files: {_layer_groups(missing)}")
    if problems:
        raise ValueError(f"{path}: weights {'; '.join(problems)}; transformers would start them from random values, "
                         "which no analysis or evaluation should see: give the complete weights")
    return model


def load_hf_model(path: str | Path, *, dtype: str = "fp32", device: str | torch.device = "cpu",
                  device_map: str | dict[str, Any] | None = None, offload_folder: str | None = None,
                  name: str | None = None) -> HFDepthModel:
    """A supported Hugging Face model from a local directory, in eval mode, with its tokenizer (None
    when the directory has none).

    dtype: "fp32", "bf16" or "fp16" (the weights are cast when loaded). device: where the whole model
    goes; device_map instead: transformers' placement over several devices ("auto", "balanced",
    "sequential", or {module name: device}; needs accelerate), for a model larger than one device;
    what fits no device is offloaded to CPU memory, or to `offload_folder` on disk.
    """
    directory = inspect_hf_directory(path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
    tokenizer = load_hf_tokenizer(directory.path)
    transformers = import_transformers()
    kwargs: dict[str, Any] = {dtype_keyword(transformers): DTYPES[dtype], "local_files_only": True,
                              "trust_remote_code": False}
    if device_map is not None:
        if importlib.util.find_spec("accelerate") is None:
            raise ValueError(f"--device-map {device_map} needs accelerate: pip install accelerate "
                             "(or give --device for a model that fits one device)")
        kwargs["device_map"] = device_map
        if offload_folder is not None:
            kwargs["offload_folder"] = offload_folder
    model = load_complete_pretrained(transformers, directory.path, **kwargs)
    if device_map is None:
        model.to(device)
    model.eval()
    try:
        blocks = directory.family.block_list(model)
    except AttributeError as e:
        raise ValueError(f"{path}: transformers {transformers.__version__} built {type(model).__name__}, which has "
                         f"no {directory.family.blocks} block list ({e})") from e
    placement = "a device map" if device_map is not None else str(device)
    logger.info("%s: %s, %d layers, %s on %s", path, type(model).__name__, len(blocks), dtype, placement)
    return HFDepthModel(model, directory.family, name=name or directory.path.resolve().name,
                        norm_scheme=directory.norm_scheme, source=f"Hugging Face {directory.model_type}, {dtype}",
                        tokenizer=tokenizer)
