"""Loading checkpoint files without running code stored in them.

``torch.load`` unpickles: a crafted file can run any code it likes unless ``weights_only=True``
restricts the unpickler to tensors, containers and plain values. lnstrain's own files (RNG states,
consolidated state dicts) hold nothing else and always load that way; exports are safetensors.

DeepSpeed's files also pickle a few of DeepSpeed's own record classes: the ZeRO partition map's
``fragment_address``, ``ZeroStageEnum`` and the loss scaler's settings (``LossScaler``, and
``DynamicLossScaler`` under fp16). Those are plain records (found by saving ZeRO 0-3, bf16, tensor-
and pipeline-parallel checkpoints and listing their pickles' globals), so they are allow-listed and
every DeepSpeed file still loads with ``weights_only=True``: in the tools (``load_deepspeed_file``),
and on resume, where ``loading_safely`` puts the same loader under DeepSpeed's own
``engine.load_checkpoint`` and ``zero_to_fp32``. A file that needs anything else is refused with a
``CheckpointError`` naming it; only when the user says the checkpoint is trusted (``--allow-pickle``,
``checkpoint.allow_pickle``) is such a file fully unpickled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from lnstrain.checkpoint.engine_hooks import replaced
from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.pickle_scan import PickleScan, scan_torch_file
from lnstrain.deepspeed_adapter import CheckpointFileIO, pickled_record_classes, zero3_fp32_state_dict
from lnstrain.no_follow import open_regular_file
from lnstrain.report_lines import escaped

logger = logging.getLogger(__name__)

OPT_IN = "--allow-pickle (config: checkpoint.allow_pickle: true)"
"""How a user says a checkpoint is trusted; named in every refusal."""


def load_tensors(path: str | os.PathLike) -> Any:
    """An lnstrain file (state dict, RNG state): tensors and plain values only, whatever the opt-in
    says (lnstrain never writes anything else there, so a file that needs more was altered)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        if _is_refusal(error):
            raise CheckpointError(f"{path} holds objects beyond tensors and plain values, which lnstrain never "
                                  "writes there: the file was altered after it was saved; nothing of it was "
                                  "loaded") from error
        raise CheckpointError(f"cannot read {path}: {type(error).__name__}: {error}") from error


def _is_refusal(error: Exception) -> bool:
    # torch raises UnpicklingError or RuntimeError for a global outside the allow-list, by version
    return isinstance(error, pickle.UnpicklingError) or "Weights only load failed" in str(error)


def refusal_message(path: str | os.PathLike, needs: str) -> str:
    return (f"{path} holds {needs}, so loading it could run code stored in it; nothing of it was loaded. "
            f"If you trust where this checkpoint came from, pass {OPT_IN}")


def load_deepspeed_file(path: str | os.PathLike, allow_pickle: bool = False, map_location: Any = "cpu") -> Any:
    """A DeepSpeed checkpoint file (``*_model_states.pt``, ``*_optim_states.pt``).

    Loads with ``weights_only=True`` plus DeepSpeed's record classes. A file that needs more raises
    ``CheckpointError`` unless ``allow_pickle`` (the caller trusts the file's origin), in which case
    it is fully unpickled, as DeepSpeed's own loader would. A file that cannot be read at all
    (truncated, not a torch file) raises ``CheckpointError`` naming it.
    """
    try:
        with torch.serialization.safe_globals(pickled_record_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        if not _is_refusal(error):
            raise CheckpointError(f"cannot read {path}: {type(error).__name__}: {error}") from error
        if not allow_pickle:
            found = scan(path)
            raise CheckpointError(refusal_message(path, "objects beyond tensors and DeepSpeed's known records"
                                                  + (f" ({escaped(', '.join(found.names))})" if found.names else ""))) from error
    logger.warning("loading %s with full unpickling (allow_pickle): it can run code", path)
    return torch.load(path, map_location=map_location, weights_only=False)


def scan(path: str | os.PathLike) -> PickleScan:
    """The classes and functions ``path``'s pickles name beyond what ``load_deepspeed_file`` allows,
    read without unpickling, in either of torch's layouts (``pickle_scan``); a file that cannot be
    opened or scanned is reported as such, never as clean."""
    try:
        descriptor = open_regular_file(path)
    except OSError as error:
        return PickleScan(unscannable=f"it cannot be opened: {error.strerror or error}")
    try:
        return scan_torch_file(descriptor, pickled_record_classes())
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def loading_safely(file_io: CheckpointFileIO, allow_pickle: bool) -> Iterator[None]:
    """Every file DeepSpeed's ``load_checkpoint`` reads goes through ``load_deepspeed_file``.

    DeepSpeed reads model states, pipeline layer files and optimizer partitions through ``file_io``
    (``TrainingEngine.checkpoint_files``), whose torch implementation unpickles fully; this replaces
    its ``load`` on that instance for the duration.
    """
    def load(path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(path, allow_pickle, map_location)

    with replaced(file_io, "load", load):
        yield


def zero3_fp32_weights(step_dir: str | os.PathLike, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32`` reader of a ZeRO-3 checkpoint, with every file it opens loaded
    through ``load_deepspeed_file`` (it calls ``torch.load(..., weights_only=False)`` itself)."""
    def load(path: Any, map_location: Any) -> Any:
        return load_deepspeed_file(path, allow_pickle, map_location)

    return zero3_fp32_state_dict(step_dir, load)
