"""What lnstrain stores beside DeepSpeed's files in each ``global_step<N>/`` directory.

    global_step<N>/lnstrain_metadata.json   step, consumed samples, data fingerprint, tokenizer checksum,
                                             layout, lnstrain version (JSON: no pickled code)
    global_step<N>/config.yaml              the resolved run config
    global_step<N>/rng/rank_<R>.pt          rank R's python/numpy/torch RNG states (tensors and plain
                                             values only, loaded with ``weights_only=True``)
    global_step<N>/lnstrain_complete        written last, after every rank finished writing: a
                                             directory without it is an interrupted save and is ignored
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from lnstrain.checkpoint import save_points
from lnstrain.checkpoint.safe_load import load_tensors
from lnstrain.no_follow import create_exclusively, is_real_directory, read_regular_file

METADATA_FILE = "lnstrain_metadata.json"
CONFIG_FILE = "config.yaml"
COMPLETE_MARKER = "lnstrain_complete"
RNG_DIR = "rng"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"global_step(0|[1-9][0-9]{0,17})")
MAX_METADATA_BYTES = 1 << 20
MAX_CONFIG_BYTES = 16 << 20


@dataclass
class CheckpointMetadata:
    """The training position and provenance of one checkpoint."""

    step: int
    consumed_samples: int
    tokens_seen: int
    data_fingerprint: str | None
    tokenizer_checksum: str | None
    lnstrain_version: str
    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    zero_stage: int
    precision: str
    format_version: int = FORMAT_VERSION
    skipped_sample_ranges: list[list[int]] = dataclasses.field(default_factory=list)
    """[start, end) ranges of consumed samples never trained on (rolled back or skipped on purpose)."""
    nonfinite_steps: int = 0
    loss_spikes: int = 0
    skipped_batches: int = 0
    lr_schedule: dict[str, Any] | None = None
    """``{"configured": ..., "in_effect": ...}``: the learning-rate schedule the run's config asked for
    and the one it followed (they differ after a resume with another schedule:
    ``lnstrain.training.schedule``); None in checkpoints from before it was recorded."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> "CheckpointMetadata":
        """Parse and type-check; raises ``ValueError`` naming ``source`` and what is wrong."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as error:
            raise ValueError(f"{source}: not JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: not an lnstrain checkpoint metadata file (not a JSON object)")
        names = {f.name for f in dataclasses.fields(cls)}
        optional = {f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        missing = sorted(n for n in names if n not in data and n not in optional)
        if missing:
            raise ValueError(f"{source}: not an lnstrain checkpoint metadata file (missing {', '.join(missing)})")
        metadata = cls(**{k: v for k, v in data.items() if k in names})
        wrong = metadata._type_problems()
        if wrong:
            raise ValueError(f"{source}: {'; '.join(wrong)}")
        return metadata

    def _type_problems(self) -> list[str]:
        problems = []
        counts = ("step", "consumed_samples", "tokens_seen", "nonfinite_steps", "loss_spikes", "skipped_batches",
                  "format_version")
        sizes = ("world_size", "tensor_parallel", "pipeline_parallel", "data_parallel")
        for name in counts + sizes + ("zero_stage",):
            value = getattr(self, name)
            lowest = 1 if name in sizes else 0
            if type(value) is not int or not lowest <= value < 2 ** 62:
                problems.append(f"{name} is {value!r:.40}, not a whole number >= {lowest}")
        for name in ("data_fingerprint", "tokenizer_checksum"):
            if not isinstance(getattr(self, name), (str, type(None))):
                problems.append(f"{name} is {getattr(self, name)!r:.40}, not a string")
        for name in ("lnstrain_version", "precision"):
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} is {getattr(self, name)!r:.40}, not a string")
        if not (self.lr_schedule is None or (isinstance(self.lr_schedule, dict)
                                             and set(self.lr_schedule) == {"configured", "in_effect"})):
            problems.append(f"lr_schedule is {self.lr_schedule!r:.60}, not the configured and in-effect schedules")
        ranges = self.skipped_sample_ranges
        if not isinstance(ranges, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(type(x) is int and x >= 0 for x in r) and r[0] < r[1]
                for r in ranges):
            problems.append(f"skipped_sample_ranges is {ranges!r:.60}, not a list of [start, end) sample ranges")
        return problems


def step_dir_name(step: int) -> str:
    return f"global_step{step}"


def step_of(path: str | os.PathLike) -> int | None:
    """N for a directory named ``global_step<N>`` (N written without leading zeros), else None."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(step_dir: str | os.PathLike) -> bool:
    """Whether ``step_dir`` (a real directory) has a completion marker: its save got to the end.
    Whether the marker and the files hold what the save wrote is ``verifier``'s to say."""
    return is_real_directory(step_dir) and os.path.lexists(Path(step_dir) / COMPLETE_MARKER)


def read_metadata(step_dir: str | os.PathLike) -> CheckpointMetadata:
    """Parse ``lnstrain_metadata.json``; raises ``ValueError`` (or ``OSError``) naming it when it cannot
    be read. Only a verified checkpoint's metadata is read (``verifier``)."""
    path = Path(step_dir) / METADATA_FILE
    try:
        text = read_regular_file(path, MAX_METADATA_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    return CheckpointMetadata.from_json(text, str(path))


def saved_config_data(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping a step directory's ``config.yaml`` holds; ``ValueError`` (or ``OSError``) naming it
    when it is not UTF-8 YAML of an lnstrain run config (a model section, no ``base:``)."""
    try:
        data = yaml.safe_load(read_regular_file(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not a YAML run config ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: not an lnstrain run config (no model section)")
    if "base" in data:
        raise ValueError(f"{path}: names base files, which a resolved config never does")
    return data


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike) -> None:
    """Flush every file and directory under ``directory`` (inclusive) to stable storage.

    Other ranks may be writing there at the same time: a temporary file renamed away between
    listing and opening is skipped (its final name is flushed by the rank that wrote it). So is
    anything lnstrain did not write (a link, a pipe): verifying the checkpoint refuses it.
    """
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fsync_file(os.path.join(root, name))
            except FileNotFoundError:
                pass
            except OSError as error:
                if error.errno not in (errno.ELOOP, errno.EINVAL):
                    raise
        fsync_file(root)


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file, fsync it, rename it over ``path``, fsync the directory.
    Neither name is followed if it is a link: the temporary file is created new, the rename replaces."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with os.fdopen(create_exclusively(temporary), "w", encoding="utf-8") as handle:
        save_points.reached("temporary file opened", path)
        handle.write(text)
        handle.flush()
        save_points.reached("temporary file written", path)
        os.fsync(handle.fileno())
    save_points.reached("temporary file fsynced", path)
    os.replace(temporary, path)
    save_points.reached("renamed into place", path)
    fsync_file(path.parent)


# --- RNG states -------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    version, mt_state, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]),
                  "has_gauss": int(numpy_state["has_gauss"]), "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state({"bit_generator": numpy["bit_generator"],
                         "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
                         "has_gauss": numpy["has_gauss"], "gauss": numpy["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_file(step_dir: str | os.PathLike, rank: int) -> Path:
    return Path(step_dir) / RNG_DIR / f"rank_{rank:05d}.pt"


def save_rng_state(step_dir: str | os.PathLike, rank: int, state: dict[str, Any] | None = None) -> None:
    """Write ``state`` (default: this process's RNG states now, ``capture_rng_state``) as rank ``rank``'s."""
    path = rng_file(step_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(create_exclusively(path), "wb") as handle:  # a new file: never a planted link's target
        torch.save(capture_rng_state() if state is None else state, handle)


def load_rng_state(step_dir: str | os.PathLike, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s saved RNG states, or None when the checkpoint has no file for it."""
    path = rng_file(step_dir, rank)
    if not os.path.lexists(path):
        return None
    return load_tensors(path)
