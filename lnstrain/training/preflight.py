"""Everything that can be checked before any process group exists, reported together.

A problem found after ``init_distributed`` costs a queue wait and can leave ranks hanging in a
collective; so the launcher runs ``preflight_problems`` first and refuses to start on any.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import yaml

from lnstrain.checkpoint.manager import data_mismatch_problems, resolve_resume
from lnstrain.checkpoint.metadata import CONFIG_FILE, read_metadata
from lnstrain.config.run_config import Config

logger = logging.getLogger(__name__)


def tokenizer_checksum(config: Config) -> str | None:
    from lnstrain.data.tokenizer import file_sha256

    return file_sha256(config.data.tokenizer) if config.data.tokenizer else None


def tokenizer_problems(config: Config) -> list[str]:
    """The model's vocabulary must hold every id the tokenizer can produce."""
    path = config.data.tokenizer
    if not path or not os.path.isfile(path):
        return []  # a missing file is reported by data.validate()
    from lnstrain.data.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer(path)
    except ValueError as error:
        return [f"data.tokenizer: {error}"]
    if tokenizer.vocab_size > config.model.vocab_size:
        return [f"data.tokenizer {path} has {tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{config.model.vocab_size}; set model.vocab_size to at least {tokenizer.vocab_size} "
                f"(--set model.vocab_size={tokenizer.vocab_size}) or use a smaller tokenizer"]
    return []


def writable_dir_problems(path: Path, key: str) -> list[str]:
    """Create ``path`` if needed and prove a file can be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".lnstrain-write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return [f"{key}: cannot write to {path} ({error.strerror or error}); set {key} to a writable directory"]
    return []


def model_mismatch_problems(config: Config, step_dir: Path) -> list[str]:
    """The model shape must be the checkpoint's (DeepSpeed would fail later, after the queue wait)."""
    try:
        saved = yaml.safe_load((step_dir / CONFIG_FILE).read_text(encoding="utf-8")).get("model", {})
    except (OSError, yaml.YAMLError, AttributeError) as error:
        return [f"checkpoint.resume: cannot read {step_dir / CONFIG_FILE}: {error}"]
    return [f"model.{key} is {value!r} but the checkpoint {step_dir} has {saved.get(key)!r}; resume with the "
            f"checkpoint's model, or start a new run (another run.name, or checkpoint.resume: none)"
            for key, value in config.to_dict()["model"].items() if saved.get(key) != value]


def resume_problems(config: Config, compare_data: bool = True, world_size: int | None = None) -> list[str]:
    """The checkpoint to resume from exists, is complete, has this run's model shape, can be
    resharded to this run's layout (given ``world_size``) and (``compare_data``) was trained on this
    run's data and tokenizer."""
    step_dir, problems = resolve_resume(config.checkpoint.resume, config.checkpoint_dir)
    if step_dir is None or problems:
        return problems
    problems = model_mismatch_problems(config, step_dir)
    if world_size is not None and not problems:
        from lnstrain.checkpoint.reshard import reshard_problems

        layout = (config.parallel.tensor, config.parallel.pipeline, config.data_parallel_size(world_size))
        problems += reshard_problems(step_dir, layout, config.checkpoint.reshard_with_fresh_optimizer)
    if config.checkpoint.allow_data_mismatch or not compare_data:
        return problems
    from lnstrain.data.fingerprint import data_fingerprint

    try:
        metadata = read_metadata(step_dir)
        fingerprint = data_fingerprint(config.data)
    except (OSError, ValueError) as error:
        return [f"checkpoint.resume: cannot read {step_dir}: {error}"]
    return problems + data_mismatch_problems(metadata, step_dir, fingerprint, tokenizer_checksum(config))


def data_file_problems(config: Config) -> list[str]:
    """Every token file that exists must be a whole, consistent ``.idx``/``.bin`` pair whose token ids fit
    the model's vocabulary (missing files are reported by ``data.validate``). Reading a large ``.bin``
    for its id range takes a while once; the range is cached beside the ``.idx``."""
    from lnstrain.data.indexed_dataset import IndexedDataset
    from lnstrain.data.token_check import token_id_range

    problems = []
    vocab = config.model.vocab_size
    for key, sources in (("data.sources", config.data.sources), ("data.valid_sources", config.data.valid_sources)):
        for index, source in enumerate(sources):
            prefix = source.prefix
            if not (os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")):
                continue
            where = f"{key}[{index}].prefix"
            try:
                IndexedDataset(prefix)
                low, high = token_id_range(prefix)
            except (OSError, ValueError) as error:  # CorruptDatasetError is a ValueError naming the file
                problems.append(f"{where}: {error}; recreate it with tools/preprocess_data.py")
                continue
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                problems.append(f"{where}: {prefix}.bin holds token id {bad}, outside the model's vocabulary "
                                f"[0, {vocab}): it was tokenized with another tokenizer (re-run "
                                "tools/preprocess_data.py with data.tokenizer, or fix model.vocab_size)")
    return problems


def device_problems(config: Config) -> list[str]:
    """What this machine cannot run: fp16 needs a GPU (DeepSpeed's CPU accelerator refuses it)."""
    import torch

    if config.precision.dtype == "fp16" and not torch.cuda.is_available():
        return ["precision.dtype: fp16 needs a GPU and this machine has none (DeepSpeed's CPU accelerator "
                "has no fp16); use bf16 or fp32 here (--set precision.dtype=bf16)"]
    return []


def preflight_problems(config: Config, world_size: int, typing_problems: list[str] | None = None) -> list[str]:
    """Every problem with the config, its files, this machine, the output directories and the resume
    checkpoint, beside the config's ``typing_problems`` (unknown keys, wrong types: the config was
    built with defaults in their place).

    Creates the run and checkpoint directories (proving they are writable), unless the config has
    typing problems (its paths may not be the ones meant).
    """
    from lnstrain.training.engine import layout_problems

    typing_problems = list(typing_problems or [])
    problems = list(dict.fromkeys(typing_problems + config.validate(world_size) + layout_problems(config, world_size)))
    problems += device_problems(config)
    problems += tokenizer_problems(config)
    problems += data_file_problems(config)
    if typing_problems:
        return problems
    run_dir_problems = writable_dir_problems(config.run.dir, "run.output_dir")
    problems += run_dir_problems
    checkpoint_key = "checkpoint.dir" if config.checkpoint.dir else "run.output_dir"
    if config.checkpoint.dir or not run_dir_problems:
        problems += writable_dir_problems(config.checkpoint_dir, checkpoint_key)
    if not problems:
        problems += resume_problems(config, compare_data=True, world_size=world_size)
    else:
        problems += resume_problems(config, compare_data=False)  # fingerprints need readable data
    return problems
