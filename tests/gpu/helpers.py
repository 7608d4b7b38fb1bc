"""Pieces the GPU tests share: the device under test, relative errors, an aten-op recorder, and running a
function in a spawned rank whose DeepSpeed engine lives on a chosen device.

The suite runs on CUDA when there is a GPU. ``LNSTRAIN_GPU_TESTS_DEVICE=cpu`` runs the same tests with
the CPU as the device under test (CPU-meaningful tolerances where they differ), so that the harness,
its references and its comparisons are proven before they meet a GPU.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lnstrain.testing.distributed import run_distributed

DEVICE_ENV = "LNSTRAIN_GPU_TESTS_DEVICE"
NO_CUDA_REASON = (f"no CUDA device: the GPU suite runs on a GPU machine (bash launch/gpu_check.sh), or on the CPU "
                  f"with {DEVICE_ENV}=cpu")


def requested_device() -> str:
    """``cuda`` (the default) or ``cpu``, from ``LNSTRAIN_GPU_TESTS_DEVICE``."""
    requested = os.environ.get(DEVICE_ENV, "cuda").strip().lower()
    if requested not in ("cuda", "cpu"):
        raise ValueError(f"{DEVICE_ENV}={requested!r}: use 'cuda' (the default) or 'cpu'")
    return requested


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """‖actual − reference‖ / ‖reference‖ in fp64 on the CPU (inf for NaN: NaN never passes)."""
    actual, reference = actual.detach().double().cpu(), reference.detach().double().cpu()
    if not torch.isfinite(actual).all():
        return float("inf")
    return float((actual - reference).norm() / reference.norm().clamp_min(1e-30))


class OpRecorder(TorchDispatchMode):
    """The names of the aten ops that run inside it (below autograd: the kernels actually chosen)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))

    def any_contains(self, fragment: str) -> bool:
        return any(fragment in name for name in self.names)


def use_accelerator(device_type: str) -> None:
    """Make DeepSpeed (not yet imported in this fresh process) place engines on ``device_type``, and
    check that it does. On a GPU machine the CPU reference needs ``DS_ACCELERATOR=cpu``."""
    if device_type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    elif os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        raise RuntimeError(f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} is set; unset it to test CUDA")
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device_type:
        raise RuntimeError(f"DeepSpeed's accelerator is {name!r}, expected {device_type!r}")


def _on_device(rank: int, world_size: int, device_type: str, deterministic: bool, fn: Callable[..., Any],
               args: tuple) -> Any:
    if deterministic:  # before the first matmul: cuBLAS reads its workspace setting when it starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    use_accelerator(device_type)
    return fn(rank, world_size, *args)


def run_on(device_type: str, fn: Callable[..., Any], *args: Any, deterministic: bool = False,
           timeout_s: float = 600.0) -> Any:
    """``fn(0, 1, *args)`` in one spawned rank whose DeepSpeed accelerator is ``device_type`` (NCCL on
    CUDA, gloo on the CPU); its result, which must hold CPU tensors only."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    (result,) = run_distributed(_on_device, 1, device_type, deterministic, fn, args, timeout_s=timeout_s,
                                backend=backend, start_method="spawn")  # DeepSpeed picks its device on import
    return result
