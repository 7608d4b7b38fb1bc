"""Loading checkpoint files without running code stored in them.

``torch.load`` unpickles: a crafted file can run any code it likes unless ``weights_only=True``
restricts the unpickler to tensors, containers and plain values. lnstrain's own files (RNG states,
consolidated state dicts) hold nothing else and always load that way; exports are safetensors.

DeepSpeed's files also pickle a few of DeepSpeed's own data classes (the ZeRO partition map's
``fragment_address``, the ``ZeroStageEnum`` and the fp16 ``LossScaler`` settings). They are plain
records, so ``load_deepspeed_file`` allow-lists exactly those and still loads with
``weights_only=True``. Only when a file holds something else (another DeepSpeed version's classes)
and the caller explicitly trusts it does it fall back to full unpickling: that fallback is the one
place in lnstrain's conversion code that may run pickled code.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import torch

logger = logging.getLogger(__name__)


def load_tensors(path: str | os.PathLike) -> Any:
    """An lnstrain file (state dict, RNG state): tensors and plain values only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def _deepspeed_safe_classes() -> list[type]:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, ZeroStageEnum, LossScaler]


def load_deepspeed_file(path: str | os.PathLike, allow_pickle: bool = False) -> Any:
    """A DeepSpeed checkpoint file (``*_model_states.pt``, ``*_optim_states.pt``) on the CPU.

    Loads with ``weights_only=True`` plus DeepSpeed's three record classes. If the file needs more,
    it raises unless ``allow_pickle`` (the caller trusts the file's origin), in which case the file
    is fully unpickled, as DeepSpeed's own loader does.
    """
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_classes()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError or RuntimeError, by version
        if not isinstance(error, pickle.UnpicklingError) and "Weights only load failed" not in str(error):
            raise
        if not allow_pickle:
            raise ValueError(f"{path} holds objects beyond tensors and DeepSpeed's known records, so it "
                             "cannot be loaded without running pickled code; if you trust where it came "
                             "from, pass --allow-pickle (allow_pickle=True)\n" + str(error).splitlines()[-1]) from error
        logger.warning("loading %s with full unpickling (allow_pickle=True): it can run code", path)
        return torch.load(path, map_location="cpu", weights_only=False)
