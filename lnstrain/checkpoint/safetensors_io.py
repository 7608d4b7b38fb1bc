"""Writing safetensors files with the permissions every other output has (``0666 & ~umask``), as new
files.

``safetensors.torch.save_file`` creates its files 0600 whatever the umask, so an export or a
consolidated checkpoint was unreadable to the group that can read the run's other files. It also
opens its path for writing as it finds it, through a link planted there (an export into a run
directory); so it writes into a new directory of its own beside the target, and the file is renamed
into place (``no_follow``: a link at the target is replaced, never written through).
"""

from __future__ import annotations

import os
import shutil
import tempfile
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
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))  # 0700, a name nobody knew
    try:
        written = private / path.name
        save_file(tensors, str(written), metadata=metadata)
        os.chmod(written, 0o666 & ~current_umask())
        os.replace(written, path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return path
