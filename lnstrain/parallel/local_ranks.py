"""Ranks on this machine: the rendezvous environment of a single-node job (``single_rank_env`` makes a
plain ``python`` launch a one-rank world), and ``run_distributed``, which runs a function on N ranks
(CPU with gloo, or one GPU per rank with NCCL): what every multi-rank test and the memory matrix use.

Ranks are never forked from the caller (a forked child inherits the caller's threads and torch state,
which deadlocks gloo). By default they fork from multiprocessing's fork server, a clean process that
has imported torch, DeepSpeed, lnstrain's trainer and what an engine build imports once, which saves
each rank those seconds of imports; ``start_method="spawn"`` starts a fresh interpreter per rank
instead, for code that must import DeepSpeed itself (it chooses its accelerator on import). Either
way a rank runs with the caller's current environment variables and working directory, finds the
others on a free local port, logs with a rank prefix, and all are killed if any rank fails or the
timeout passes, so a broken collective fails the test instead of hanging it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

logger = logging.getLogger(__name__)
RankFunction = Callable[..., Any]
RENDEZVOUS_FAILED = "rendezvous failed"
RENDEZVOUS_ATTEMPTS = 3
"""Gloo's full-mesh connect on localhost now and then fails with "Connection closed by peer" while both
ranks are healthy (a few runs in a hundred on a loaded 2-core machine; a port taken between
``free_port`` and the store's bind does the same): the ranks are started again on a new port, as an
elastic launcher restarts its workers, up to this many times in all."""
# The first torch optimizer imports torch._dynamo, and DeepSpeed's ZeRO optimizer check imports
# torch.compile's backend (torch._inductor): together ~5 s of every engine build in a new process.
FORK_SERVER_MODULES = ["torch", "torch.distributed", "deepspeed", "lnstrain.training.trainer", "torch._dynamo",
                       "torch._inductor.compile_fx"]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def distributed_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torch.distributed and DeepSpeed read for a single-node job."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}


def single_rank_env() -> dict[str, str]:
    """The environment of a one-rank world on a free local port (a launch without a launcher)."""
    return distributed_env(0, 1, free_port())


def _rank_main(fn: RankFunction, rank: int, world_size: int, port: int, args: tuple,
               results: "mp.Queue", threads_per_rank: int, backend: str, environment: dict[str, str],
               directory: str) -> None:
    os.environ.clear()  # the fork server's environment is the one it started with
    os.environ.update(environment | distributed_env(rank, world_size, port))
    os.chdir(directory)
    logging.basicConfig(level=logging.INFO, force=True, stream=sys.stderr,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads_per_rank)
    try:
        if backend == "nccl":  # NCCL needs each rank on its own device before the first collective
            torch.cuda.set_device(rank)
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        except Exception:  # nothing of fn ran: the caller may start the ranks again
            results.put((rank, RENDEZVOUS_FAILED, traceback.format_exc()))
            return
        value = fn(rank, world_size, *args)
        # Plain pickle copies tensor data into the bytes; the queue's own pickler would share it
        # through memory that disappears when this process exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report anything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: RankFunction, world_size: int, *args: Any, timeout_s: float = 300.0,
                    backend: str = "gloo", start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of this machine; return their results by rank.

    ``fn`` must be importable (defined at module level) and its arguments and result picklable.
    ``backend`` ``nccl`` puts rank r on CUDA device r (one GPU per rank). ``start_method``:
    ``forkserver`` or ``spawn`` (see the module's docstring). Raises ``RuntimeError`` with the failing
    rank's traceback, or ``TimeoutError``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl' (got {backend!r})")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn' (got {start_method!r})")
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(FORK_SERVER_MODULES)  # takes effect when the server starts
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return _run_ranks(context, fn, world_size, args, timeout_s, backend)
        except _RendezvousFailed as failure:
            if attempt == RENDEZVOUS_ATTEMPTS:
                raise RuntimeError(f"the {world_size} ranks could not connect in {RENDEZVOUS_ATTEMPTS} attempts; "
                                   f"the last:\n{failure}") from None
            logger.warning("the %d ranks could not connect (attempt %d of %d); starting them again on a new port:\n%s",
                           world_size, attempt, RENDEZVOUS_ATTEMPTS, failure)
    raise AssertionError("unreachable")


class _RendezvousFailed(Exception):
    """A rank's ``init_process_group`` failed; its traceback is the message."""


def _run_ranks(context: Any, fn: RankFunction, world_size: int, args: tuple, timeout_s: float,
               backend: str) -> list[Any]:
    results = context.Queue()
    port = free_port()
    threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    processes = [context.Process(target=_rank_main, daemon=False,
                                 args=(fn, rank, world_size, port, args, results, threads_per_rank, backend,
                                       dict(os.environ), os.getcwd()))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(processes)
                        if r not in values and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"ranks {dead} died (exit codes "
                                       f"{[processes[r].exitcode for r in dead]}) without reporting")
                continue
            if ok == RENDEZVOUS_FAILED:
                raise _RendezvousFailed(f"rank {rank} of {world_size}:\n{value}")
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=10 if len(values) == world_size else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
    return [values[rank] for rank in range(world_size)]
