"""Everything that can be checked before any process group exists, reported together.

A problem found after ``init_distributed`` costs a queue wait and can leave ranks hanging in a
collective; so the launcher runs ``run_problems`` first, on every rank, and refuses to start on any.
Every check here is local (files, this machine's devices): no rank waits for another, and ranks that
read the same files reach the same verdict. docs/training.md lists what is checked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.locations import link_problems, resolve_resume
from lnstrain.checkpoint.manager import data_mismatch_problems
from lnstrain.checkpoint.metadata import CONFIG_FILE, read_metadata, saved_config_data, step_of
from lnstrain.checkpoint.verifier import QUICK, Trust, check_step_dir, choose_checkpoint, nothing_verifies
from lnstrain.config.loader import Typed, to_dict
from lnstrain.config.run_config import Config
from lnstrain.model.config import ModelConfig
from lnstrain.report_lines import escaped
from lnstrain.tracking.wandb_sink import wandb_problems

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
    pieces, rows = tokenizer.vocab_size, config.model.vocab_size
    if pieces > rows:
        return [f"data.tokenizer {path} has {pieces} pieces but model.vocab_size is {rows}: the model has no "
                f"embedding for ids {rows}..{pieces - 1}; set model.vocab_size to {pieces} "
                f"(--set model.vocab_size={pieces}) or use a tokenizer of at most {rows} pieces"]
    if pieces < rows:
        logger.info("data.tokenizer has %d pieces and model.vocab_size is %d: %d embedding rows will never be used "
                    "(--set model.vocab_size=%d would fit the tokenizer exactly)", pieces, rows, rows - pieces, pieces)
    return []


def writable_dir_problems(path: Path, key: str) -> list[str]:
    """``path`` can be created (or, existing, written): a directory, or its nearest existing parent,
    that this user may write. Nothing is created: a refused launch leaves no empty run directory."""
    existing = next((candidate for candidate in (path, *path.parents) if os.path.lexists(candidate)), None)
    problem = None
    if existing is None:
        problem = "no parent of it exists"
    elif not existing.is_dir():
        problem = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable by this user" + (" (a read-only file system)" if _read_only(existing)
                                                              else "")
    if problem is None:
        return []
    return [f"{key}: cannot write to {escaped(path)} ({problem}); set {key} to a writable directory"]


def _read_only(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def run_trust(config: Config) -> Trust | None:
    """The run's opt-ins and signing key (``verifier.Trust``); None when the key file is unusable
    (``signing_key_problems`` says why)."""
    try:
        return Trust.from_config(config.checkpoint, [config.run.dir, config.checkpoint_dir])
    except CheckpointError:
        return None


def signing_key_problems(config: Config) -> list[str]:
    """``checkpoint.signing_key_file`` is a readable key of the owner's only, outside the run and
    checkpoint directories."""
    try:
        Trust.from_config(config.checkpoint, [config.run.dir, config.checkpoint_dir])
    except CheckpointError as error:
        return [str(error)]
    return []


def model_mismatch_problems(config: Config, step_dir: Path) -> list[str]:
    """The model shape must be the checkpoint's (DeepSpeed would fail later, after the queue wait)."""
    try:
        saved = saved_config_data(step_dir / CONFIG_FILE)["model"]
    except (OSError, ValueError) as error:
        return [f"checkpoint.resume: cannot read {step_dir / CONFIG_FILE}: {error}"]
    # A key the checkpoint does not record is newer than it: its default is what that lnstrain computed.
    defaults = to_dict(ModelConfig())
    return [f"model.{key} is {value!r} but the checkpoint {step_dir} has {saved.get(key, defaults.get(key))!r}; resume "
            f"with the checkpoint's model, or start a new run (another run.name, or checkpoint.resume: none)"
            for key, value in config.to_dict()["model"].items()
            if key not in ModelConfig.EXECUTION_ONLY_KEYS and saved.get(key, defaults.get(key)) != value]


def resume_problems(config: Config, compare_data: bool = True, world_size: int | None = None) -> list[str]:
    """The checkpoint to resume from exists, is complete, has this run's model shape, can be
    resharded to this run's layout (given ``world_size``) and (``compare_data``) was trained on this
    run's data and tokenizer."""
    step_dir, problems = resolve_resume(config.checkpoint.resume, config.checkpoint_dir, log=False)
    trust = run_trust(config)
    if step_dir is None or problems or trust is None:
        return problems
    explicit = step_of(Path(config.checkpoint.resume)) is not None
    choice = choose_checkpoint(step_dir, trust, not explicit, lambda d: check_step_dir(d, trust, depth=QUICK), log=False)
    if choice.step_dir is None:  # QUICK scans no pickles: never a refusal
        return [nothing_verifies(step_dir, explicit, choice.skipped)]
    step_dir = choice.step_dir  # what the resume will verify in full, and fall back from if need be
    problems = model_mismatch_problems(config, step_dir)
    if world_size is not None and not problems:
        from lnstrain.checkpoint.reshard import reshard_problems

        layout = (config.parallel.tensor, config.parallel.pipeline, config.shard_replicas(world_size))
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


FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with float8 tensor cores (Ada); ``torch._scaled_mm`` refuses older."""


def device_problems(config: Config, local_rank: int) -> list[str]:
    """This machine can run the precision, and has a GPU for this rank (lnstrain uses GPU ``LOCAL_RANK``)."""
    import torch

    dtype, attention, fp8 = config.precision.dtype, config.model.attention_backend, config.precision.fp8
    if not torch.cuda.is_available():
        problems = []
        if dtype == "fp16":  # DeepSpeed's CPU accelerator takes it only on CPUs with fp16 instructions
            problems.append("precision.dtype is fp16, which needs a CUDA GPU, and this machine has none "
                            "(torch.cuda.is_available() is false); on CPU ranks use precision.dtype: bf16 or fp32")
        if attention in ("cudnn", "efficient"):
            problems.append(f"model.attention_backend is {attention}, a CUDA kernel, and this machine has no CUDA GPU; "
                            "on the CPU use auto, flash or math")
        return problems
    problems = []
    count = torch.cuda.device_count()
    if local_rank >= count:
        problems.append(f"this is local rank {local_rank} but the machine shows {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); each rank uses GPU LOCAL_RANK: start at "
                        f"most {count} rank(s) per machine")
    elif dtype == "fp16":
        major, minor = torch.cuda.get_device_capability(local_rank)
        deprecated_ok = major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16") == "1"
        if major < 7 and not deprecated_ok:  # DeepSpeed's CUDA accelerator refuses it the same way
            problems.append(f"precision.dtype is fp16, which DeepSpeed supports from compute capability 7.0, and "
                            f"{torch.cuda.get_device_name(local_rank)} is {major}.{minor}; use precision.dtype: fp32"
                            + (" (or DS_ALLOW_DEPRECATED_FP16=1)" if major == 6 else ""))
    if local_rank < count and fp8 != "none" and torch.cuda.get_device_capability(local_rank) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(local_rank)
        problems.append(f"precision.fp8 is {fp8}, whose float8 matrix products need compute capability 8.9 or newer "
                        f"(Ada, Hopper, Blackwell), and {torch.cuda.get_device_name(local_rank)} is {major}.{minor}; "
                        "set precision.fp8: none")
    return problems


def checkpoint_bytes(config: Config) -> int:
    """A lower bound of one checkpoint's size: the weights in the training dtype, fp32 master weights
    (bf16/fp16) and Adam's two fp32 moments per parameter (the tiny test model: 518 kB estimated, 531 kB
    written)."""
    per_parameter = 4 + 8 if config.precision.dtype == "fp32" else 2 + 4 + 8
    return per_parameter * config.model.num_parameters(tensor_parallel=config.parallel.tensor)


def checkpoint_space_problems(config: Config) -> list[str]:
    """The checkpoint directory's file system has room for one checkpoint (a full one fails at the first
    save, after hours of training; retention deletes old checkpoints only after a new one is complete)."""
    from lnstrain.checkpoint.write_errors import free_space, human_bytes

    ckpt = config.checkpoint
    if not (ckpt.interval_steps or ckpt.interval_minutes or ckpt.save_at_end):
        return []
    space, needed = free_space(config.checkpoint_dir), checkpoint_bytes(config)
    if space is None or space[0] >= needed:
        return []
    key = "checkpoint.dir" if ckpt.dir else "run.output_dir"
    return [f"{key}: one checkpoint of this model needs at least {human_bytes(needed)} (weights and Adam state) but "
            f"the file system holding {config.checkpoint_dir} has {human_bytes(space[0])} free; free space there or "
            f"set {key} to a larger file system"]


def async_save_problems(config: Config, world_size: int, local_ranks: int, report: bool = True) -> list[str]:
    """``checkpoint.async_save: true`` where checkpoints cannot be written in the background (another
    DeepSpeed checkpoint engine), or where this machine's ranks' snapshots would not fit in its host
    memory. Unset, the same findings are logged (``report``) and the run goes on: saves then block."""
    import torch

    from lnstrain.estimate.snapshot_memory import background_save_refusal, host_memory, snapshot_shortfall

    if config.checkpoint.async_save is False:
        return []
    refusal = background_save_refusal(config) or snapshot_shortfall(config, world_size, local_ranks,
                                                                      torch.cuda.is_available(), host_memory())
    if refusal is None:
        return []
    if config.checkpoint.async_save:
        return [f"checkpoint.async_save is true but {refusal}; set checkpoint.async_save: false (every save then "
                "blocks training until its files are written), or leave it unset to save in the background where "
                "the snapshot fits"]
    if report:
        logger.warning("checkpoints will block training while they are written: %s (checkpoint.async_save)", refusal)
    return []


def file_problems(config: Config) -> list[str]:
    """The token files open and fit the vocabularies; ``checkpoint.init_from`` names loadable weights."""
    from lnstrain.checkpoint.init_from_checks import init_from_problems
    from lnstrain.data.file_checks import token_file_problems

    tokenizer_vocab = None
    if config.data.tokenizer and os.path.isfile(config.data.tokenizer):
        from lnstrain.data.tokenizer import Tokenizer

        try:
            tokenizer_vocab = Tokenizer(config.data.tokenizer).vocab_size
        except ValueError:
            pass  # reported by tokenizer_problems
    problems = token_file_problems(config.data, config.model.vocab_size, tokenizer_vocab)
    problems += signing_key_problems(config)
    step_dir, _ = resolve_resume(config.checkpoint.resume, config.checkpoint_dir, log=False)
    trust = run_trust(config)
    if config.checkpoint.init_from and step_dir is None and trust is not None:  # a resumed run ignores init_from
        problems += init_from_problems(config.checkpoint.init_from, config.model, config.checkpoint.init_from_unfold_lns,
                                       trust)
    return problems


def downstream_problems(config: Config, rank: int) -> list[str]:
    """``train.eval_tasks`` can be evaluated: checkpoints at those steps and at the end, a model with a
    Hugging Face LLaMA form, and (global rank 0, which evaluates; indexing lm-eval's tasks takes seconds)
    lm-eval installed, every task name known to it and every task's data loadable. Where the Hub does
    not answer, rank 0 stays offline (``stay_offline_unless_the_hub_answers``): a task whose data is not
    cached is refused here in one line, not retried and logged with a traceback at every evaluation."""
    train = config.train
    if not train.eval_tasks:
        return []
    problems = []
    every = config.checkpoint.interval_steps
    if train.eval_tasks_interval and (not every or train.eval_tasks_interval % every):
        problems.append(f"train.eval_tasks_interval ({train.eval_tasks_interval}) must be a multiple of "
                        f"checkpoint.interval_steps ({every}): the tasks are evaluated on the checkpoints of those steps")
    if not config.checkpoint.save_at_end:
        problems.append("train.eval_tasks are evaluated on the final checkpoint: set checkpoint.save_at_end: true")
    from lnstrain.checkpoint.hf_exportable import export_problems

    problems += [f"train.eval_tasks go through the Hugging Face export, which refuses this model: {problem}"
                 for problem in export_problems(config.model)]
    if rank == 0 and not problems:
        from lnstrain.evaluation.downstream import (DownstreamTasks, stay_offline_unless_the_hub_answers,
                                                    task_data_problems, task_problems)

        offline = stay_offline_unless_the_hub_answers()
        tasks = DownstreamTasks(list(train.eval_tasks), list(train.eval_tasks_include_path))
        problems += task_problems(tasks, key="train.eval_tasks")
        if not problems:
            problems += task_data_problems(tasks, offline, key="train.eval_tasks")
    return problems


def in_use_problems(config: Config) -> list[str]:
    """A trainer running on this run's directories now (the trainer's own lock decides; this says it
    before any rank waits at the rendezvous)."""
    from lnstrain.training.run_lock import lock_directories, probe

    directories = lock_directories(config.run.dir, config.checkpoint_dir)
    return [message for message in map(probe, directories) if message]


def preflight_problems(config: Config, world_size: int, local_rank: int = 0,
                       unreadable_keys: tuple[str, ...] = (), rank: int = 0,
                       local_ranks: int | None = None) -> list[str]:
    """Every problem with the config, this machine, the files, the output directories and the resume checkpoint.

    Creates the run and checkpoint directories (proving they are writable), unless a key that
    places them is in ``unreadable_keys`` (keys whose written value could not be read, which hold
    their defaults; problems that name them are left out). Only global rank 0 looks for another
    trainer on the run directory: rank 0 of this launch may already hold it while another rank is
    still checking (nothing makes every rank finish its checks first), and must not be taken for another
    trainer. ``local_ranks``: the ranks on this machine (default: all of them), whose checkpoint
    snapshots share its host memory.
    """
    from lnstrain.config.deepspeed_json import deepspeed_config_problems

    problems = config.validate(world_size)
    if not problems:  # DeepSpeed's own parser needs a consistent layout (it divides by it)
        problems += deepspeed_config_problems(config, world_size)
    problems += device_problems(config, local_rank)
    if not problems:  # the estimate needs a consistent layout
        problems += async_save_problems(config, world_size, local_ranks or world_size, report=local_rank == 0)
    problems += tokenizer_problems(config)
    problems += file_problems(config)
    problems += wandb_problems(config.logging.wandb)
    problems += downstream_problems(config, rank)
    unreadable = Typed(None, unreadable_keys=list(unreadable_keys))
    places_output = ("run.output_dir", "run.name", "checkpoint.dir")
    if not any(unreadable.about_unreadable_keys(key) for key in places_output):
        run_dir_problems = writable_dir_problems(config.run.dir, "run.output_dir")
        problems += run_dir_problems
        checkpoint_key = "checkpoint.dir" if config.checkpoint.dir else "run.output_dir"
        if config.checkpoint.dir or not run_dir_problems:
            checkpoint_dir_problems = writable_dir_problems(config.checkpoint_dir, checkpoint_key)
            problems += checkpoint_dir_problems or checkpoint_space_problems(config)
        problems += link_problems(config.run.dir, config.checkpoint_dir)
        if rank == 0:
            problems += in_use_problems(config)
    if not problems:
        problems += resume_problems(config, compare_data=True, world_size=world_size)
    else:
        problems += resume_problems(config, compare_data=False)  # fingerprints need readable data
    return [problem for problem in problems if not unreadable.about_unreadable_keys(problem)]


def run_problems(typed: Typed[Config], world_size: int, local_rank: int = 0, rank: int = 0,
                 local_ranks: int | None = None) -> list[str]:
    """``read_config``'s typing problems and, when the config could be built, every preflight problem."""
    if typed.value is None:
        return list(typed.problems)
    return typed.problems + preflight_problems(typed.value, world_size, local_rank, tuple(typed.unreadable_keys),
                                               rank, local_ranks)
