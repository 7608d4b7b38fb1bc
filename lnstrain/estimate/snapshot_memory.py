"""Host memory for checkpoint snapshots (``checkpoint.async_save``): the one rule, for everything that
asks whether a save can be written in the background.

A save written in the background first copies the rank's checkpoint state into host memory
(``estimate.memory.StageMemory.snapshot``), kept from the first save on. The snapshots of one
machine's ranks must fit in its available memory with ``MEMORY_RESERVE_FRACTION`` of its total kept
free; without a GPU the training state lives in host memory too and is counted. Only the config
decides whether another DeepSpeed checkpoint engine rules the background out.

Used by the pre-launch check (``training.preflight``), the trainer, the ``--dry-run`` report
(``estimate.report``) and the snapshot itself (``checkpoint.async_save``, which applies the same
rule to each state dict when it copies it). Nothing here imports ``lnstrain.checkpoint``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lnstrain.config.run_config import Config

MEMORY_RESERVE_FRACTION = 0.05
"""Host memory a snapshot leaves free: this fraction of the machine's total, for everything else."""


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of this machine's memory (Linux ``/proc/meminfo``), None elsewhere."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


def fits_in_host_memory(needed: float, memory: tuple[int, int] | None) -> bool:
    """Whether ``needed`` bytes fit in ``memory`` = (available, total) with the reserve kept free; an
    unknown memory (None) is taken to fit."""
    return memory is None or needed <= memory[0] - MEMORY_RESERVE_FRACTION * memory[1]


def _gib(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"


def snapshot_shortfall(config: Config, world_size: int, local_ranks: int, on_gpu: bool,
                       memory: tuple[int, int] | None) -> str | None:
    """Why this machine's ranks' snapshots would not fit in its memory (``memory`` = (available,
    total)), or None when they fit or the memory is unknown."""
    from lnstrain.estimate.memory import memory_estimate

    if memory is None:
        return None
    estimate = memory_estimate(config, world_size, device="cuda" if on_gpu else "cpu")
    per_rank = estimate.snapshot + (0.0 if on_gpu else estimate.total)
    if fits_in_host_memory(local_ranks * per_rank, memory):
        return None
    needed = local_ranks * per_rank + MEMORY_RESERVE_FRACTION * memory[1]
    what = "snapshot" if on_gpu else "training state and snapshot"
    return (f"the checkpoint snapshots of the {local_ranks} rank(s) on this machine need about {_gib(needed)} of host "
            f"memory ({_gib(per_rank)} of {what} per rank, {MEMORY_RESERVE_FRACTION:.0%} kept free) but "
            f"{_gib(memory[0])} is available")


def background_save_refusal(config: Config) -> str | None:
    """Why this config's checkpoints cannot be written in the background, None when they can. Only the
    config decides, so every rank reaches the same verdict."""
    def section(value: Any) -> dict:
        return value if isinstance(value, dict) else {}

    chosen = [name for name, selected in (
        ("checkpoint.writer", section(config.deepspeed.get("checkpoint")).get("writer")),
        ("datastates", section(config.deepspeed.get("datastates")).get("enabled"))) if selected]
    if chosen:
        return (f"the deepspeed: section selects another DeepSpeed checkpoint engine ({', '.join(chosen)}), whose "
                "writes lnstrain cannot stage, hash or publish")
    return None
