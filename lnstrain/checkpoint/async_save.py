"""Checkpoints written in the background (``checkpoint.async_save``): a host snapshot taken at the step
boundary, then the files written, hashed and fsynced by a thread while training goes on.

At the step boundary the save runs exactly as a synchronous one up to the first byte written: the
finiteness check, rank 0 preparing the step directory, and DeepSpeed's ``save_checkpoint`` with its
collectives, on the main thread. Each state dict DeepSpeed hands to its checkpoint engine is then
copied into host memory (``HostSnapshot``: every tensor storage once, views kept as views, containers
and DeepSpeed's records copied, so ``torch.save`` of the copy writes the bytes a synchronous save
writes) and queued instead of written; the RNG states and metadata are captured too. A
``BackgroundWrite`` thread then writes the queue through the same writer a synchronous save uses
(streamed SHA-256, ``save_points``, the held failure of ``save_agreement``) and fsyncs the directory.

Publishing stays on the main thread at a step boundary (``CheckpointManager.publish_if_written``):
once every rank's thread is done, the ranks gather their file records and failures in the same
collective as a synchronous save, and rank 0 writes the completion marker and ``latest``. No
torch.distributed call is ever made from the thread. Until then ``latest`` names the previous
checkpoint, so a kill at any moment of the write leaves it as it was.

The snapshot's host buffers are kept from one save to the next (pinned when the state is on a GPU,
where pinning is slow): ``checkpoint.async_save`` holds one checkpoint's worth of this rank's state
in host memory from its first save on (``lnstrain.estimate.memory``, ``StageMemory.snapshot``). A
state dict whose copy would not fit in the memory available at that moment (the rule of
``lnstrain.estimate.snapshot_memory``) is written at once
instead, on the main thread, as a synchronous save would (a warning says so). The thread runs at the
lowest CPU priority (nice 19): where training keeps every core busy it writes in the gaps, and the
next save waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lnstrain.checkpoint.engine_hooks import replaced
from lnstrain.checkpoint.save_agreement import HeldFailure
from lnstrain.checkpoint.write_errors import human_bytes
from lnstrain.deepspeed_adapter import CheckpointFileIO
from lnstrain.estimate.snapshot_memory import fits_in_host_memory, host_memory

logger = logging.getLogger(__name__)

WRITER_NICENESS = 19
"""The background writer's nice value (Linux: per thread; the SHA-256 helper it starts inherits it)."""
_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


# --- the snapshot --------------------------------------------------------------------------------------
class SnapshotBuffers:
    """Host buffers that snapshots are copied into, reused by the next save of the same sizes."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        free = self._free.get((nbytes, pinned))
        buffer = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._lent.append(buffer)
        return buffer

    def new_bytes(self, sizes: list[tuple[int, bool]]) -> int:
        """Bytes that taking buffers of these (size, pinned) would newly allocate."""
        wanted = collections.Counter(sizes)
        return sum(nbytes * max(0, count - len(self._free.get((nbytes, pinned), [])))
                   for (nbytes, pinned), count in wanted.items())

    def give_back(self) -> None:
        """Every buffer lent is free again (its snapshot was written)."""
        for buffer in self._lent:
            self._free.setdefault((buffer.numel(), buffer.is_pinned()), []).append(buffer)
        self._lent.clear()

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._lent) + sum(b.numel() for free in self._free.values() for b in free)


def _storages(value: Any, found: dict[int, torch.UntypedStorage], seen: set[int]) -> None:
    """Every distinct tensor storage under ``value`` (containers walked; other objects are small)."""
    if isinstance(value, _ATOMS) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        found.setdefault(storage._cdata, storage)
    elif isinstance(value, dict):
        for item in value.values():
            _storages(item, found, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _storages(item, found, seen)


class HostSnapshot:
    """Copies of state dicts in host memory that ``torch.save`` writes exactly as it writes the
    originals: each storage copied once (views of one storage stay views of one copy), containers of
    the same types with the same attributes (a module state dict's ``_metadata``), objects shared
    between places still shared, and DeepSpeed's records (loss scaler, ...) deep-copied.

    Sharing is kept within one state dict (one file; ``torch.save`` keeps no more): objects are known
    by ``id`` and storages by address, which only the state dict being copied keeps from being reused.
    """

    def __init__(self, buffers: SnapshotBuffers) -> None:
        self.buffers = buffers
        self.bytes = 0
        """Bytes copied so far, over every state dict."""
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._copies: dict[int, Any] = {}
        self._deepcopy_memo: dict[int, Any] = {}
        self._cuda_devices: set[torch.device] = set()

    def new_bytes(self, state_dict: Any) -> int:
        """Host bytes a snapshot of ``state_dict`` would allocate (its storages, less reused buffers)."""
        found: dict[int, torch.UntypedStorage] = {}
        _storages(state_dict, found, set())
        return self.buffers.new_bytes([(s.nbytes(), s.device.type == "cuda") for s in found.values()])

    def copy(self, state_dict: Any) -> Any:
        """The host copy of ``state_dict``, complete (GPU copies synchronised) when this returns."""
        try:
            copied = self._copy(state_dict)
            for device in self._cuda_devices:
                torch.cuda.synchronize(device)
        finally:
            self._storages.clear()
            self._copies.clear()
            self._deepcopy_memo.clear()
            self._cuda_devices.clear()
        return copied

    def _copy(self, value: Any) -> Any:
        if isinstance(value, _ATOMS):
            return value
        known = self._copies.get(id(value), self)
        if known is not self:
            return known
        if isinstance(value, torch.Tensor):
            copied = self._tensor(value)
        elif isinstance(value, dict):
            copied = copy.copy(value)  # the same type (OrderedDict, defaultdict's factory) and attributes
            self._copies[id(value)] = copied
            for key, item in value.items():
                copied[key] = self._copy(item)
            for name, attribute in vars(value).items() if hasattr(value, "__dict__") else ():
                setattr(copied, name, self._copy(attribute))
            return copied
        elif isinstance(value, list) and type(value) is list:
            copied = []
            self._copies[id(value)] = copied
            copied.extend(self._copy(item) for item in value)
            return copied
        elif isinstance(value, tuple):
            items = [self._copy(item) for item in value]
            if all(a is b for a, b in zip(items, value)):
                copied = value  # nothing mutable inside: the same object, as pickle will see it
            elif hasattr(value, "_fields"):
                copied = type(value)._make(items)
            else:
                copied = type(value)(items)
        else:  # DeepSpeed's records and anything else: small, and must not change under the writer
            copied = copy.deepcopy(value, self._deepcopy_memo)
        self._copies[id(value)] = copied
        return copied

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            raise TypeError(f"cannot snapshot a {type(tensor).__name__}")
        storage = tensor.untyped_storage()
        host = self._storages.get(storage._cdata)
        if host is None:
            on_gpu = storage.device.type == "cuda"
            buffer = self.buffers.take(storage.nbytes(), pinned=on_gpu)
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            buffer.copy_(source, non_blocking=on_gpu)
            if on_gpu:
                self._cuda_devices.add(storage.device)
            host = buffer.untyped_storage()
            self._storages[storage._cdata] = host
            self.bytes += storage.nbytes()
        copied = torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())
        if isinstance(tensor, nn.Parameter):
            copied = nn.Parameter(copied, requires_grad=tensor.requires_grad)
        elif tensor.requires_grad:
            copied.requires_grad_(True)
        for name, attribute in vars(tensor).items():  # pickled with the tensor
            setattr(copied, name, self._copy(attribute))
        return copied


# --- the background write ------------------------------------------------------------------------------
def _lower_this_threads_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError) as error:  # not Linux, or not permitted: write at normal priority
        logger.debug("the background checkpoint writer keeps its priority: %s", error)


class BackgroundWrite:
    """One save's files: snapshotted on the main thread at the step boundary, written by a thread.

    Every write goes through ``held`` as a synchronous save's do: the first failure is kept and the
    remaining files are skipped; the main thread raises it on every rank when it publishes.
    """

    def __init__(self, step_dir: Path, held: HeldFailure, buffers: SnapshotBuffers) -> None:
        self.step_dir = step_dir
        self.held = held
        self.snapshot: HostSnapshot | None = HostSnapshot(buffers)
        self.records: dict[str, Any] = {}
        """The files' records (``integrity.FileRecord`` by name), filled in as they are written."""
        self.blocking_seconds = 0.0
        """How long the save kept training waiting: the finiteness check, DeepSpeed's save with the
        snapshot, the RNG states."""
        self.snapshot_seconds = 0.0
        """How long the copies into host memory took (part of the time the save blocks training)."""
        self.write_seconds = 0.0
        """How long the thread took, once it is done."""
        self.foreground_files: list[str] = []
        """Files written at once on the main thread, and why (no snapshot could be taken)."""
        self._jobs: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._buffers = buffers

    def stage(self, state_dict: Any, path: str, write: Callable[[Any, str], None]) -> None:
        """Queue ``write(copy of state_dict, path)``; write at once when the copy would not fit in the
        host memory available, or cannot be made (the reason is logged)."""
        started = time.monotonic()
        needed = self.snapshot.new_bytes(state_dict)
        if needed and not fits_in_host_memory(needed, host_memory()):
            self.foreground_files.append(f"{Path(path).name} (its snapshot does not fit in the host memory available)")
            write(state_dict, path)
            return
        try:
            snapshot = self.snapshot.copy(state_dict)
        except (TypeError, MemoryError, RuntimeError) as error:  # an unknown tensor type, an allocation that failed
            self.foreground_files.append(f"{Path(path).name} ({type(error).__name__}: {error})")
            write(state_dict, path)
            return
        finally:
            self.snapshot_seconds += time.monotonic() - started
        self._jobs.append(lambda: write(snapshot, path))

    def start(self, records: dict[str, Any], own_files: Callable[[], None], blocking_seconds: float) -> None:
        """Start the thread: the staged files, then ``own_files()`` (the RNG states, metadata and config
        captured at the step boundary, and the fsync), each recorded in ``records``."""
        self.records = records
        self.blocking_seconds = blocking_seconds
        self._jobs.append(own_files)
        if self.foreground_files:
            logger.warning("%s: written before training went on, as a synchronous save would: %s", self.step_dir,
                           "; ".join(self.foreground_files))
        logger.info("checkpoint %s: %s of state copied to host memory, training blocked %.1f s; writing it in the "
                    "background", self.step_dir, human_bytes(self.snapshot.bytes), blocking_seconds)
        self._thread = threading.Thread(target=self._run, name=f"lnstrain-save-{self.step_dir.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        _lower_this_threads_priority()
        try:
            for job in self._jobs:
                if self.held.error is not None:
                    break
                with self.held.catching():
                    job()
        finally:
            self._jobs.clear()  # the snapshot's last references: its buffers may be reused now
            self.snapshot = None
            self._buffers.give_back()
            self.write_seconds = time.monotonic() - started

    @property
    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> float:
        """Wait for the thread; returns the seconds waited."""
        started = time.monotonic()
        if self._thread is not None:
            self._thread.join()
        return time.monotonic() - started


@contextlib.contextmanager
def staging_deepspeed_files(file_io: CheckpointFileIO, background: BackgroundWrite) -> Iterator[None]:
    """Inside DeepSpeed's ``save_checkpoint``: each file DeepSpeed saves through ``file_io``
    (``TrainingEngine.checkpoint_files``) is snapshotted and queued on ``background`` instead of written;
    the queued write is whatever ``file_io.save`` was when this block was entered."""
    write = file_io.save

    def save(state_dict: Any, path: str) -> None:
        background.stage(state_dict, path, write)

    with replaced(file_io, "save", save):
        yield
