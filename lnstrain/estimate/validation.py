"""Config checks for a dry run: everything except the existence of the data files.

A dry run plans a run before its data exists (placeholder prefixes in shipped configs), so the
data section's file checks become notes instead of problems.
"""

from __future__ import annotations

from lnstrain.config.run_config import Config


def split_file_problems(config: Config, world_size: int | None) -> tuple[list[str], list[str]]:
    """(every problem except missing files, the missing-file notes)."""
    return config.validate(world_size, check_files=False), config.data.file_problems()
