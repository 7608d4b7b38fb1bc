"""The model lm-evaluation-harness scores: a transformers causal language model and its tokenizer.

Two sources:

- **an lnstrain checkpoint** of any layout (run, checkpoint or ``global_step<N>`` directory): read as
  the single-process state dict (``layouts.read_full_state``), turned into the Hugging Face export's
  tensors and config.json by the functions ``tools/convert_to_hf.py`` writes with
  (``hf_io.export_tensors``, ``hf_io.export_config``: LNS factors folded in), and loaded into
  ``LlamaForCausalLM`` in memory: no weight is written anywhere. Only the tokenizer files (a few kB)
  pass through a temporary directory, so that ``AutoTokenizer`` reads exactly what an export holds.
  In fp32 the model computes the checkpoint's logits (tests/checkpoint/test_hf_export.py).
- **a Hugging Face model directory**: ``AutoModelForCausalLM.from_pretrained`` from local files, never
  with remote code.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lnstrain.analysis.hf_source import DTYPES, dtype_keyword, load_complete_pretrained, read_hf_config, safetensors_problems
from lnstrain.analysis.text_tokens import import_transformers
from lnstrain.checkpoint.lns_fold import RECORD_KEY
from lnstrain.run_files import CHECKPOINTS_DIR, RUN_CONFIG_FILE

if TYPE_CHECKING:
    from lnstrain.checkpoint.verifier import Trust

logger = logging.getLogger(__name__)


@dataclass
class EvaluatedModel:
    """A model ready for lm-evaluation-harness, and what it is."""

    model: Any
    """A transformers ``PreTrainedModel`` in eval mode."""
    tokenizer: Any
    source: dict[str, Any] = field(default_factory=dict)
    """Written into the results: ``kind`` (lnstrain checkpoint / Hugging Face), ``path``, ``dtype``,
    and for a checkpoint ``step``, ``tokens``, ``norm_scheme``."""
    run_dir: Path | None = None
    """The run directory whose TensorBoard and W&B get the results (checkpoints only, when found)."""
    step: int | None = None
    tokens: int | None = None
    run_config: Any = None
    """The checkpoint's resolved run config (``lnstrain.config.run_config.Config``); None for Hugging Face."""


def checkpoint_run_dir(step_dir: Path, run_dir_in_config: Path) -> Path | None:
    """The run directory a checkpoint belongs to: ``<run dir>/checkpoints/global_step<N>`` as the trainer
    writes it by default, else the config's ``run.dir`` (a ``checkpoint.dir`` elsewhere) when it exists."""
    parent = step_dir.resolve().parent
    if parent.name == CHECKPOINTS_DIR and (parent.parent / RUN_CONFIG_FILE).is_file():
        return parent.parent
    return run_dir_in_config if run_dir_in_config.is_dir() else None


def _tokenizer_of_export(tokenizer_path: str | None, max_len: int) -> Any:
    """``AutoTokenizer`` of the files an export writes for the run's sentencepiece model."""
    from lnstrain.checkpoint.hf_io import write_tokenizer_files

    transformers = import_transformers()
    with tempfile.TemporaryDirectory(prefix="lnstrain-tokenizer-") as directory:
        if not write_tokenizer_files(Path(directory), tokenizer_path, max_len):
            raise ValueError(f"the checkpoint's data.tokenizer ({tokenizer_path}) is not a file: downstream tasks "
                             "are text, so the run's tokenizer is needed")
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def load_checkpoint_model(path: str | os.PathLike, dtype: str = "fp32", device: str | torch.device = "cpu",
                          trust: Trust | None = None) -> EvaluatedModel:
    """An lnstrain checkpoint of any layout as ``LlamaForCausalLM``, through the Hugging Face export in memory.
    The checkpoint is the one ``lnstrain.checkpoint.verifier`` chooses under ``trust`` (the opt-ins and
    key: --allow-pickle, --allow-unverified, --key, or a run's config; None: none).

    Raises ValueError when the model's norm scheme has no Hugging Face LLaMA form (``hf_exportable``)
    or the run's tokenizer is missing.
    """
    from lnstrain.checkpoint.hf_exportable import export_problems
    from lnstrain.checkpoint.hf_io import export_config, export_tensors
    from lnstrain.checkpoint.layouts import read_full_state, read_step_config, resolve_step_dir
    from lnstrain.checkpoint.metadata import read_metadata

    if dtype not in DTYPES:
        raise ValueError(f"a checkpoint is evaluated in fp32, bf16 or fp16 (got {dtype!r})")
    step_dir = resolve_step_dir(path, trust)
    config = read_step_config(step_dir)
    problems = export_problems(config.model)
    if problems:
        raise ValueError(f"cannot evaluate {step_dir} through the Hugging Face export:\n  " + "\n  ".join(problems))
    tokenizer = _tokenizer_of_export(config.data.tokenizer or None, config.model.max_seq_len)
    state = read_full_state(step_dir, config, with_optimizer=False, allow_pickle=bool(trust and trust.allow_pickle))
    transformers = import_transformers()
    hf_config = transformers.LlamaConfig(**export_config(config.model, dtype, config.data.tokenizer or None))
    model = transformers.LlamaForCausalLM.from_pretrained(
        None, config=hf_config, state_dict=export_tensors(state.weights, config.model, dtype),
        **{dtype_keyword(transformers): DTYPES[dtype]})
    model.to(device).eval()
    metadata = read_metadata(step_dir)
    logger.info("%s: step %d, %s, norm_scheme %s, as LlamaForCausalLM in %s on %s", step_dir, metadata.step,
                state.weights_source, config.model.norm_scheme.value, dtype, device)
    source = {"kind": "lnstrain checkpoint", "path": str(step_dir), "dtype": dtype, "step": metadata.step,
              "tokens": metadata.tokens_seen, "norm_scheme": config.model.norm_scheme.value}
    return EvaluatedModel(model, tokenizer, source, checkpoint_run_dir(step_dir, config.run.dir),
                          metadata.step, metadata.tokens_seen, config)


def hf_directory_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of a Hugging Face model directory (ValueError when it has none transformers can
    read: downstream tasks are text). Cheap: check it before any weight is read."""
    path = Path(path)
    read_hf_config(path)
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: no tokenizer transformers can read ({' '.join(str(e).split())[:200]}); downstream "
                         "tasks are text: save the model's tokenizer into the directory (tokenizer.save_pretrained)"
                         ) from e


def load_hf_directory_model(path: str | os.PathLike, dtype: str = "auto", device: str | torch.device = "cpu",
                            tokenizer: Any = None) -> EvaluatedModel:
    """A local Hugging Face causal language model and its tokenizer (``dtype`` "auto": as stored); the
    tokenizer is read first (``hf_directory_tokenizer``) unless given."""
    path = Path(path)
    hf = read_hf_config(path)
    if tokenizer is None:
        tokenizer = hf_directory_tokenizer(path)
    transformers = import_transformers()
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, fp32, bf16 or fp16 (got {dtype!r})")
        kwargs[dtype_keyword(transformers)] = DTYPES[dtype]
    else:
        kwargs[dtype_keyword(transformers)] = "auto"
    problems = safetensors_problems(path)
    if problems:
        raise ValueError("; ".join(problems))
    model = load_complete_pretrained(transformers, path, **kwargs)
    model.to(device).eval()
    record = hf.get(RECORD_KEY) or {}
    source = {"kind": "Hugging Face", "path": str(path), "dtype": str(model.dtype).removeprefix("torch."),
              "model_type": hf.get("model_type"), "norm_scheme": record.get("norm_scheme", "pre_ln")}
    logger.info("%s: %s, %s on %s", path, type(model).__name__, source["dtype"], device)
    return EvaluatedModel(model, tokenizer, source)
