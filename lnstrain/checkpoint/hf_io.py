"""Writing and reading Hugging Face LLaMA checkpoint directories (safetensors only: no pickles).

    DIR/config.json                         LlamaConfig
    DIR/model-0000K-of-0000N.safetensors    the weights, in shards of at most --shard-size
    DIR/model.safetensors.index.json        which shard holds which tensor
    DIR/tokenizer.model                     the run's sentencepiece model (data.tokenizer)
    DIR/tokenizer_config.json, special_tokens_map.json, generation_config.json
    DIR/lnstrain_unfolded_norms.safetensors the norm gains as trained, for an exact unfold (lns only;
                                            ``lns_fold``; transformers does not read it)
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from lnstrain.checkpoint.hf_llama import config_problems, from_hf_state_dict, hf_config, shards_by_size, to_hf_state_dict
from lnstrain.checkpoint.lns_fold import RECORD_KEY, UNFOLDED_WEIGHTS_FILE, folded_norm_gains, unfold_factors
from lnstrain.checkpoint.safetensors_io import save_safetensors
from lnstrain.model.config import ModelConfig
from lnstrain.no_follow import write_bytes_replacing, write_text_replacing

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB`` -> 5_000_000_000 (also KB, MB, KiB, MiB, GiB or plain bytes)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"shard size {text!r}: give a number with a unit, e.g. 5GB, 500MB, 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _special_tokens(tokenizer_path: str | None) -> dict[str, tuple[int, str]]:
    """{"bos"|"eos"|"unk"|"pad": (id, piece)} of a sentencepiece model, for the ids it defines."""
    if not tokenizer_path or not os.path.isfile(tokenizer_path):
        return {}
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_path)
    ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "unk": sp.unk_id(), "pad": sp.pad_id()}
    return {name: (i, sp.id_to_piece(i)) for name, i in ids.items() if i >= 0}


def write_tokenizer_files(output: Path, tokenizer_path: str | None, max_len: int) -> bool:
    """The run's sentencepiece model as a ``LlamaTokenizer`` (``tokenizer.model``, ``tokenizer_config.json``,
    ``special_tokens_map.json``) in ``output``; False (and a warning) when ``tokenizer_path`` is not a file."""
    special = _special_tokens(tokenizer_path)
    if not special:
        logger.warning("no tokenizer written: data.tokenizer (%s) is not a file", tokenizer_path)
        return False
    write_bytes_replacing(output / "tokenizer.model", Path(tokenizer_path).read_bytes())
    tokens = {f"{name}_token": piece for name, (_, piece) in special.items()}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": "bos" in special, "add_eos_token": False,
              "model_max_length": max_len, "clean_up_tokenization_spaces": False, "legacy": False, **tokens}
    write_text_replacing(output / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    write_text_replacing(output / "special_tokens_map.json", json.dumps(tokens, indent=2) + "\n")
    return True


def export_config(cfg: ModelConfig, dtype: str, tokenizer_path: str | None) -> dict:
    """The export's config.json: ``hf_llama.hf_config`` with the tokenizer's BOS and EOS ids."""
    special = _special_tokens(tokenizer_path)
    return hf_config(cfg, dtype, *(special.get(k, (None,))[0] for k in ("bos", "eos")))


def export_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: str) -> dict[str, torch.Tensor]:
    """The export's tensors (Hugging Face names, LNS factors folded in) in ``dtype`` ("fp32", "bf16", "fp16")."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (got {dtype!r})")
    return {name: tensor.to(_DTYPES[dtype]) for name, tensor in to_hf_state_dict(state, cfg).items()}


def save_hf_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig, output: str | os.PathLike,
                       dtype: str = "bf16", shard_size: str = "5GB", tokenizer_path: str | None = None) -> Path:
    """Write ``state`` (lnstrain's single-process state dict) as a Hugging Face LLaMA directory."""
    hf_state = export_tensors(state, cfg, dtype)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    shards = list(shards_by_size(hf_state, parse_size(shard_size)))
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, output / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    as_trained = folded_norm_gains(state, cfg)
    if as_trained:
        save_safetensors(as_trained, output / UNFOLDED_WEIGHTS_FILE, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_text_replacing(output / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    config = export_config(cfg, dtype, tokenizer_path)
    write_text_replacing(output / "config.json", json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    write_text_replacing(output / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(output, tokenizer_path, cfg.max_seq_len)
    logger.info("wrote a Hugging Face LLaMA checkpoint to %s: %d tensors in %d shard(s), %s", output,
                len(hf_state), len(shards), dtype)
    return output


def read_hf_tensors(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint (sharded with an index, or one file)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory}: no {INDEX_FILE} or model.safetensors (only safetensors "
                                "checkpoints are read: they cannot carry code)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(directory / name)))
    return tensors


def load_hf_llama_state_dict(directory: str | os.PathLike, model_cfg: ModelConfig,
                             unfold_lns: bool | None = None) -> dict[str, torch.Tensor]:
    """lnstrain's single-process fp32 state dict for ``model_cfg`` from a Hugging Face LLaMA directory.

    ``unfold_lns``: divide out the LNS factors an lnstrain export folded into the weights; None (the
    default) does so when the directory's config.json records the fold (``lns_fold``). The decision
    is logged. Raises ``ValueError`` listing every difference between config.json and ``model_cfg``
    (then load it with ``sharding.apply_full_state_dict``, which checks the shapes).
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: not a Hugging Face checkpoint directory")
    hf = json.loads(config_path.read_text(encoding="utf-8"))
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{config_path}: model_type {hf.get('model_type')!r} is not 'llama'")
    problems = config_problems(hf, model_cfg)
    if problems:
        raise ValueError(f"{directory} does not match the model config:\n  - " + "\n  - ".join(problems))
    record = hf.get(RECORD_KEY)
    factors = unfold_factors(record, model_cfg, unfold_lns, str(directory))
    side_file = directory / UNFOLDED_WEIGHTS_FILE
    as_trained = load_file(str(side_file)) if factors and side_file.is_file() else None
    return from_hf_state_dict(read_hf_tensors(directory), model_cfg, factors, as_trained)
