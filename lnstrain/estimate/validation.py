"""Config checks for a dry run: everything except the existence of the data files.

A dry run plans a run before its data exists (placeholder prefixes in shipped configs), so the
data section's file checks become notes instead of problems. They are recognised by the key and
wording ``DataConfig.validate`` uses; ``tests/estimate`` pins that wording.
"""

from __future__ import annotations

from lnstrain.config.run_config import Config


def _file_problem_prefixes(config: Config) -> tuple[str, ...]:
    prefixes = ["data.tokenizer: file not found"]
    for key, sources in (("data.sources", config.data.sources), ("data.valid_sources", config.data.valid_sources)):
        prefixes += [f"{key}[{i}].prefix: missing " for i in range(len(sources))]
    return tuple(prefixes)


def split_file_problems(config: Config, world_size: int | None) -> tuple[list[str], list[str]]:
    """``config.validate(world_size)`` split into (problems, missing-file notes)."""
    file_prefixes = _file_problem_prefixes(config)
    problems, missing_files = [], []
    for problem in config.validate(world_size):
        (missing_files if problem.startswith(file_prefixes) else problems).append(problem)
    return problems, missing_files
