"""Starting DeepSpeed's communication layer without compiling anything.

On a machine without CUDA, DeepSpeed picks its CPU accelerator, and ``deepspeed.comm`` then
JIT-compiles a shared-memory all-reduce op (and, where oneCCL's bindings are installed, a oneCCL op)
into ``~/.cache/torch_extensions`` the first time it starts in an environment. That needs a C++
compiler (slim containers have none: the run dies in ``torch.utils.cpp_extension``) and pauses the
first start ~20 s. Training never uses those ops: DeepSpeed calls the shared-memory op only in
``inference_all_reduce``; every training collective is torch.distributed's.

So, on CPU, lnstrain hands DeepSpeed (through ``deepspeed.accelerator.set_accelerator``, its hook for
custom accelerators; ``lnstrain.deepspeed_adapter`` does it) its own CPU accelerator minus those two op
builders. DeepSpeed treats a missing builder as an unavailable op and uses torch.distributed, as it does
on platforms where the op cannot be built; nothing else changes. ``DS_ACCELERATOR=cpu`` is set before
DeepSpeed is first imported, so DeepSpeed does not warn that it fell back to the CPU. On CUDA machines nothing here changes anything.
"""

from __future__ import annotations

import datetime
import logging
import os

logger = logging.getLogger(__name__)


def name_cpu_accelerator_if_no_cuda() -> None:
    """Tell DeepSpeed up front that this is a CPU run (``DS_ACCELERATOR=cpu``) unless the user chose an
    accelerator or CUDA is available. Call before ``import deepspeed``; later it changes nothing."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def use_accelerator_without_jit_ops() -> None:
    """On DeepSpeed's CPU accelerator: replace it with one whose comm op builders are absent, so that
    ``deepspeed.comm`` builds nothing. Must run before DeepSpeed's communication backend starts."""
    from lnstrain.deepspeed_adapter import JIT_COMM_OP_BUILDERS, use_cpu_accelerator_without_jit_ops

    name_cpu_accelerator_if_no_cuda()
    if use_cpu_accelerator_without_jit_ops():
        logger.debug("DeepSpeed's CPU accelerator without its JIT-compiled comm ops %s", JIT_COMM_OP_BUILDERS)


def init_deepspeed_comm(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """``deepspeed.init_distributed`` (which wraps an initialised torch.distributed, or initialises it
    from the launcher's environment) with nothing compiled. Idempotent, like DeepSpeed's."""
    use_accelerator_without_jit_ops()
    import deepspeed

    options = {"timeout": timeout} if timeout is not None else {}
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **options)
