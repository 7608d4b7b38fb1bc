"""The whole description of a run: one YAML file, parsed into the sections' dataclasses.

Each component owns its section's dataclass (model, parallel, data, ...); this file only composes
them, runs the cross-section checks (``lnstrain.config.feasibility``) with theirs, and loads, overrides
and saves the result.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from lnstrain.checkpoint.config import CheckpointConfig
from lnstrain.config.feasibility import cross_section_problems
from lnstrain.config.loader import (ConfigError, Typed, apply_overrides, apply_readable_overrides, load_yaml_with_bases,
                                   names_key, parse_override, read_dataclass, suggest, to_dict)
from lnstrain.data.config import DataConfig
from lnstrain.model.config import ModelConfig
from lnstrain.no_follow import write_text_replacing
from lnstrain.parallel.config import ParallelConfig
from lnstrain.run_files import CHECKPOINTS_DIR
from lnstrain.tracking.config import WandbConfig
from lnstrain.training.config import OptimConfig, PrecisionConfig, TrainConfig

logger = logging.getLogger(__name__)


@dataclass
class RunConfig:
    """Identity and location of a run.

    Attributes:
        name: run name; the run directory is ``<output_dir>/<name>``.
        output_dir: parent of run directories.
    """

    name: str = "run"
    output_dir: str = "runs"

    @property
    def dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def validate(self) -> list[str]:
        problems = []
        if not self.name or "/" in self.name:
            problems.append(f"run.name must be a non-empty name without '/' (got {self.name!r})")
        return problems


@dataclass
class LoggingConfig:
    """Console, TensorBoard and Weights & Biases logging.

    Attributes:
        interval: log a line (rank 0) and TensorBoard scalars every this many steps, and at the first
            step of each launch and the last step of the run.
        tensorboard: write TensorBoard event files under ``<run dir>/tensorboard``.
        depth_stats_interval: every this many steps, record per-layer statistics (residual
            variance, gradient norms, sublayer-to-residual ratios); 0 disables them. At the default
            of 100 the cost is well under 1% of training time (docs/depth_analysis.md).
        wandb: Weights & Biases tracking, off by default (``lnstrain.tracking.config.WandbConfig``):
            every scalar TensorBoard gets, the per-layer profiles and the resolved config.
    """

    interval: int = 10
    tensorboard: bool = True
    depth_stats_interval: int = 100
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> list[str]:
        problems = []
        if self.interval < 1:
            problems.append(f"logging.interval must be >= 1 (got {self.interval})")
        if self.depth_stats_interval < 0:
            problems.append(f"logging.depth_stats_interval must be >= 0 (got {self.depth_stats_interval})")
        return problems + self.wandb.validate()


@dataclass
class Config:
    """A complete run. ``deepspeed`` is passed through, merged last into the derived DeepSpeed JSON."""

    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)

    # --- derived quantities -------------------------------------------------------------------
    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.parallel.tensor * self.parallel.pipeline * self.parallel.context)

    def shard_replicas(self, world_size: int) -> int:
        """Ranks holding the same model shard, data × context: what gradients are summed over, ZeRO
        partitions its state across, and a checkpoint counts as its data-parallel size."""
        return self.data_parallel_size(world_size) * self.parallel.context

    def grad_accumulation_steps(self, world_size: int) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size(world_size))

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.data.seq_len

    @property
    def total_steps(self) -> int:
        if self.train.steps is not None:
            return self.train.steps
        return math.ceil(self.train.tokens / self.tokens_per_step)

    @property
    def warmup_steps(self) -> int:
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return int(self.optim.warmup_fraction * self.total_steps)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run.dir / CHECKPOINTS_DIR

    # --- checks -------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None, check_files: bool = True) -> list[str]:
        """Every problem with this config: each section's and every rule between sections (precision ×
        ZeRO × pipeline included, ``lnstrain.config.feasibility``), those that need the world size when given.

        ``check_files=False`` skips the existence of data and tokenizer files (planning, dry runs).
        """
        problems: list[str] = []
        problems += self.model.validate(tensor_parallel=max(self.parallel.tensor, 1))
        problems += self.data.validate(check_files=check_files)
        for section in (self.run, self.parallel, self.optim, self.train,
                        self.precision, self.checkpoint, self.logging):
            problems += section.validate()
        problems += cross_section_problems(self, world_size)
        return problems

    def check(self, world_size: int | None = None) -> "Config":
        """Raise a ``ConfigError`` listing every problem; return self when there are none."""
        problems = self.validate(world_size)
        if problems:
            raise ConfigError(problems)
        return self

    # --- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write the resolved config atomically (a new temporary file, then a rename: a link at either
        name is replaced, never written through)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_replacing(path, self.to_yaml())

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)


def _expand_model_preset(data: dict, problems: list[str]) -> dict:
    """``model: {preset: 130m, norm_scheme: lns}`` -> the preset's shape with the given keys on top."""
    model = data.get("model")
    if not isinstance(model, dict) or "preset" not in model:
        return data
    from lnstrain.model.presets import MODEL_PRESETS

    model = dict(model)
    name = model.pop("preset")
    if name not in MODEL_PRESETS:
        problems.append(f"model.preset: unknown preset {name!r}{suggest(str(name), MODEL_PRESETS)}; "
                        f"known: {', '.join(MODEL_PRESETS)}")
        return {**data, "model": model}
    return {**data, "model": {**to_dict(MODEL_PRESETS[name]), **model}}


def read_config(data: dict) -> Typed[Config]:
    """Type a raw config mapping, collecting every typing problem (``Typed``: unreadable values keep
    their defaults, so the config's own checks can still run and report everything else)."""
    problems: list[str] = []
    data = _expand_model_preset(data, problems)
    typed = read_dataclass(Config, data)
    typed.problems[:0] = problems
    return typed


def config_from_dict(data: dict, source: str = "config") -> Config:
    """Type a raw config mapping; raises ``ConfigError`` listing every typing problem."""
    typed = read_config(data)
    if typed.problems:
        raise ConfigError(typed.problems, source)
    return typed.value


def read_config_file(path: str | os.PathLike, overrides: Iterable[str] = ()) -> Typed[Config]:
    """``read_config`` of a YAML run description with ``--set``-style overrides; a malformed override
    is one more problem. Raises ``ConfigError`` only when the file cannot be read as YAML at all,
    listing with it every problem the overrides show on their own (``override_problems``)."""
    overrides = list(overrides)
    try:
        data = load_yaml_with_bases(path)
    except ConfigError as error:
        raise ConfigError(error.problems + override_problems(overrides), str(path)) from None
    data, problems = apply_readable_overrides(data, overrides)
    typed = read_config(data)
    typed.problems[:0] = problems
    return typed


def override_problems(overrides: Iterable[str]) -> list[str]:
    """What can be found wrong in ``--set`` overrides without the config they override: malformed
    ones, unknown keys and values of the wrong type, and the problems each section's own check finds
    in the keys they set (a negative train.steps, a data prefix whose files are missing). Problems
    about keys they do not set are left out: those keys hold defaults, not what the config says."""
    data, problems = apply_readable_overrides({}, overrides)
    data = _expand_model_preset(data, problems)
    given = [".".join(keys) for keys, _ in (_override_keys(text) for text in overrides) if keys]
    hints, fields = typing.get_type_hints(Config), {f.name for f in dataclasses.fields(Config)}
    for section, value in data.items():
        if section not in fields:
            problems.append(f"unknown key '{section}'{suggest(str(section), fields)}")
            continue
        if section == "deepspeed" or not isinstance(value, dict):
            problems += read_dataclass(Config, {"model": {}, section: value}).problems
            continue
        typed = read_dataclass(hints[section], value, section)
        problems += typed.problems
        if typed.value is None:
            continue
        checks = (typed.value.validate(tensor_parallel=1) if section == "model" else
                  typed.value.validate(check_files=True) if section == "data" else typed.value.validate())
        problems += [problem for problem in checks if any(names_key(problem, key) for key in given)]
    return problems


def _override_keys(text: str) -> tuple[list[str], Any]:
    try:
        return parse_override(text)
    except ConfigError:
        return [], None


def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), world_size: int | None = None,
                validate: bool = True) -> Config:
    """Load a YAML run description with ``--set``-style overrides, and check it completely."""
    config = config_from_dict(apply_overrides(load_yaml_with_bases(path), overrides), source=str(path))
    if validate:
        problems = config.validate(world_size)
        if problems:
            raise ConfigError(problems, str(path))
    return config
