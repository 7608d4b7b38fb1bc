"""Writing safetensors files with the permissions every other output has (``0666 & ~umask``).

``safetensors.torch.save_file`` creates its files 0600 whatever the umask, so an export or a
consolidated checkpoint was unreadable to the group that can read the run's other files.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def current_umask() -> int:
    mask = os.umask(0)  # reading it means setting it; set it straight back (lnstrain writes files from one thread)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> Path:
    """``save_file``, then the mode a plain ``open(path, "w")`` would have given the file."""
    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())
    return path
