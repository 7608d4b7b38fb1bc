"""Hugging Face models as a depth-analysis source, read in place through transformers (no conversion).

    model = load_hf_model("models/Llama-2-7b-hf", dtype="bf16", device="cuda")   # or device_map="auto"
    analysis = analyze_model(model, batches)

Supported (`FAMILIES`): decoder-only models whose blocks form one list, `model.layers`, each block
a Pre-LN residual block with an attention-input norm and an MLP-input norm. The architecture is read
from config.json and refused before any weight is loaded when it is not one of them. transformers
itself computes the model (its attention, masks, rotary embeddings): the analysis only hooks the
blocks (`model_source.DepthModel`). Weights are read from local files only, never with remote code.

The model's own tokenizer, when the directory has one, is `HFDepthModel.tokenizer`. The norm scheme
is "pre_ln", or what an lnstrain export's config.json records (its "lnstrain" key): an LNS model
exported with `tools/convert_to_hf.py` is analysed as "lns", with the same figures as its checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lnstrain.analysis.model_source import DepthModel
from lnstrain.analysis.text_tokens import HFDocuments, import_transformers, load_hf_tokenizer
from lnstrain.checkpoint.lns_fold import RECORD_KEY

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class HFFamily:
    """A model family the analysis can hook: where its blocks and their two pre-sublayer norms are."""

    title: str
    attention_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"


FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily("LLaMA"),
    "mistral": HFFamily("Mistral"),
    "qwen2": HFFamily("Qwen2"),
    "qwen3": HFFamily("Qwen3"),
}
"""config.json's model_type -> family; each is tested against transformers with a layer deleted."""


def supported_families() -> str:
    return ", ".join(f"{family.title} (model_type {name!r})" for name, family in FAMILIES.items())


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


def family_of(path: str | Path, config: dict[str, Any]) -> HFFamily:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported by the depth analysis; supported: "
                         f"{supported_families()}. Others need their block list and norms added to "
                         "lnstrain/analysis/hf_source.py FAMILIES, with a test")
    return FAMILIES[model_type]


class HFDepthModel(DepthModel):
    """A transformers causal language model of a supported family."""

    def __init__(self, model: nn.Module, family: HFFamily, *, name: str, norm_scheme: str = "pre_ln",
                 source: str = "Hugging Face", tokenizer: HFDocuments | None = None) -> None:
        self.module = model
        self.family = family
        self.name = name
        self.norm_scheme = norm_scheme
        self.source = source
        self.tokenizer = tokenizer
        config = model.config
        self.vocab_size = config.vocab_size
        self.max_seq_len = config.max_position_embeddings
        self._blocks = list(model.model.layers)

    def layers(self) -> Sequence[nn.Module]:
        return self._blocks

    @property
    def input_device(self) -> torch.device:
        return self.module.get_input_embeddings().weight.device

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=tokens, use_cache=False).logits

    def norm_gains(self) -> list[list[float]]:
        """Mean |gain| of each block's two norms (an lnstrain LNS export has 1/sqrt(l) folded in); empty
        when a norm's weight is offloaded where it cannot be read."""
        gains = []
        for block in self._blocks:
            weights = [_readable_weight(getattr(block, name)) for name in (self.family.attention_norm,
                                                                           self.family.mlp_norm)]
            if any(weight is None for weight in weights):
                logger.warning("%s: norm weights offloaded out of reach; no norm gains in the report", self.name)
                return []
            gains.append([float(weight.detach().float().abs().mean()) for weight in weights])
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


def load_hf_model(path: str | Path, *, dtype: str = "fp32", device: str | torch.device = "cpu",
                  device_map: str | dict[str, Any] | None = None, offload_folder: str | None = None,
                  name: str | None = None) -> HFDepthModel:
    """A supported Hugging Face model from a local directory, in eval mode, with its tokenizer.

    dtype: "fp32", "bf16" or "fp16" (the weights are cast when loaded). device: where the whole model
    goes; device_map instead: transformers' placement over several devices ("auto", "balanced",
    "sequential", or {module name: device}; needs accelerate), for a model larger than one device;
    what fits no device is offloaded to CPU memory, or to `offload_folder` on disk.
    """
    path = Path(path)
    config = read_hf_config(path)
    family = family_of(path, config)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (got {dtype!r})")
    if not any((path / name).is_file() for name in _WEIGHT_FILES):
        raise ValueError(f"{path}: no weights ({' or '.join(_WEIGHT_FILES)})")
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
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if device_map is None:
        model.to(device)
    model.eval()
    if not hasattr(getattr(model, "model", None), "layers"):
        raise ValueError(f"{path}: transformers built {type(model).__name__}, which has no model.layers block list")
    record = config.get(RECORD_KEY) or {}
    placement = "a device map" if device_map is not None else str(device)
    logger.info("%s: %s, %d layers, %s on %s", path, type(model).__name__, len(model.model.layers), dtype, placement)
    return HFDepthModel(model, family, name=name or path.resolve().name,
                        norm_scheme=record.get("norm_scheme", "pre_ln"),
                        source=f"Hugging Face {config['model_type']}, {dtype}", tokenizer=load_hf_tokenizer(path))
