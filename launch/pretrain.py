#!/usr/bin/env python
"""Pretrain a LLaMA-family model from one YAML run description.

    python launch/pretrain.py --config configs/demo.yaml --set train.steps=50      # one process
    deepspeed --log_level warning --master_port 29600 launch/pretrain.py --config configs/7b_lns.yaml
    deepspeed --log_level warning --master_port 29600 --num_gpus 2 launch/pretrain.py --config configs/demo.yaml
    python launch/pretrain.py --config configs/7b_lns.yaml --dry-run --world-size 16   # estimate only

(--master_port: the launcher's default port, 29500, is often taken on a shared machine; --log_level
warning: without the launcher's informational lines.)
Everything that can be checked without process groups (the config, the data and tokenizer files,
the output directories, the checkpoint to resume from) is checked first, and every problem is
reported together with exit code 2; so is a checkpoint that cannot be resumed safely (a file
whose pickle would run code, no checkpoint whose files verify). A save that cannot write (no space,
no permission, on any rank) stops every rank with exit 1 and one message naming the rank, the path
and the free space. SIGTERM, SIGUSR1, a first Ctrl-C (or train.exit_after_minutes) make every rank
save after the same step and exit 75, with a line naming the command that resumes; a second Ctrl-C
stops at once (exit 130). SIGUSR2 makes a rank write every thread's Python stack to its stderr and go
on (train.stack_dump_after_minutes: also after that long in one step). Rerunning a finished run says so
and changes nothing.
Exit status: 0 finished, 1 failed, 2 nothing started, 3 stopped by non-finite losses, 75 stopped to
be resumed (the same command continues), 130 interrupted; see lnstrain/training/outcome.py. A console
that goes away (| tee killed by the Ctrl-C, a full disk) changes none of this: rank 0 writes every line,
the stop and resume lines included, to <run dir>/lnstrain.log as well.
The console shows lnstrain's own lines and every warning; --verbose adds DeepSpeed's and other
libraries' informational messages.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lnstrain.config.loader import ConfigError, add_override_argument  # noqa: E402  (no torch: fast)
from lnstrain.help_formatter import HelpFormatter  # noqa: E402
from lnstrain.run_files import TENSORBOARD_DIR  # noqa: E402
from lnstrain.training.outcome import (  # noqa: E402
    EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_FINISHED, EXIT_INTERRUPTED, EXIT_STOPPED, finished_step)
from lnstrain.training.rerun_command import resume_command  # noqa: E402
from lnstrain.training.run_log import RunLog, guard_console  # noqa: E402

EXIT_SAVE_FAILED = 1
logger = logging.getLogger("lnstrain.launch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="run description (YAML)")
    add_override_argument(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the memory and throughput estimate and exit without starting anything (missing "
                             "data files are noted in it; other config problems stop it, exit 2)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="with --dry-run: the number of ranks to estimate for (default: $WORLD_SIZE when a "
                             "launcher sets it, else parallel.tensor x parallel.pipeline, one data-parallel replica)")
    parser.add_argument("--resume", metavar="PATH",
                        help="resume from this checkpoint directory or global_step<N> directory "
                             "(same as --set checkpoint.resume=PATH)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="the checkpoint to resume from is trusted: fully unpickle its files that hold more than "
                             "tensors and DeepSpeed's known records, which can run code stored in them (same as "
                             "--set checkpoint.allow_pickle=true); without it such a file stops the launch")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="resume a checkpoint whose files cannot be verified: saved by an lnstrain before checksums, "
                             "or, with checkpoint.signing_key_file, unsigned (same as --set "
                             "checkpoint.allow_unverified=true); a damaged or forged checkpoint is never used")
    parser.add_argument("--stop-at-step", type=int, default=None, metavar="N",
                        help="save after step N and exit 75, as a signal would (a staged run: the same command "
                             "without it continues); a run already at step N or later exits 75 at once")
    parser.add_argument("--verbose", action="store_true",
                        help="also show DeepSpeed's and other libraries' informational messages and lnstrain's "
                             "debug messages (default: lnstrain's progress lines and every warning)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


RUN_LOG = RunLog()
"""Rank 0's ``<run dir>/lnstrain.log`` once the checks have passed (lnstrain/training/run_log.py)."""


def tell(message: str) -> None:
    """One message for the user, on stderr and in the run's log (``RunLog.tell``)."""
    RUN_LOG.tell(message)


def fail(problems: list[str], source: str) -> None:
    lines = "\n".join(f"  - {problem}" for problem in problems)
    tell(f"lnstrain: {len(problems)} problem(s) in {source}; nothing was started:\n{lines}")
    sys.exit(EXIT_BAD_CONFIG)


PEER_REPORT_WAIT_S = 60.0
"""How long a rank other than 0 that found problems waits to be stopped by its launcher before listing them too."""


def fail_on_every_rank(problems: list[str], source: str, rank: int, world_size: int) -> None:
    """Exit 2 on this rank; the list is printed once, by rank 0. Every rank runs the same checks on the
    same files, so the others found the same problems: each waits for the launcher to stop it after rank
    0's exit (DeepSpeed's and torchrun's do within seconds) and lists its own problems only if it is
    still running after ``PEER_REPORT_WAIT_S`` (no such launcher, or a problem only its machine has)."""
    if rank != 0:
        time.sleep(PEER_REPORT_WAIT_S)
        source = f"{source} (rank {rank} of {world_size} on {socket.gethostname()})"
    fail(problems, source)


def dry_run(args: argparse.Namespace, overrides: list[str], world_size: int) -> None:
    """Print the estimate (rank 0 only); missing data files are noted in it, other problems stop it."""
    from lnstrain.config.run_config import load_config

    config = load_config(args.config, overrides, world_size, validate=False)
    if args.world_size is not None:
        world_size = args.world_size
    elif "WORLD_SIZE" not in os.environ:
        world_size = max(config.parallel.tensor * config.parallel.pipeline, 1)
    from lnstrain.estimate.report import dry_run_report

    report = dry_run_report(config, world_size)  # raises ConfigError listing the config's problems
    if int(os.environ.get("RANK", "0")) == 0:
        print(report)


def already_finished(config) -> int | None:
    """The step this run already finished at (``final_metrics.json``), or None to train. Only for
    ``checkpoint.resume: auto``: naming a checkpoint to start from is a request to train from it."""
    if config.checkpoint.resume != "auto":
        return None
    try:
        total_steps = config.total_steps
    except (TypeError, ValueError, ZeroDivisionError):  # a bad train.steps/tokens: preflight says which
        return None
    return finished_step(config.run.dir, total_steps)


def configure_logging(rank: int, verbose: bool) -> None:
    """lnstrain's progress from rank 0 and warnings from every rank; with ``verbose`` also lnstrain's
    debug messages and other libraries' (DeepSpeed's: ``init_distributed``) informational ones."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stdout, force=True,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    own_level = logging.DEBUG if verbose else logging.INFO
    logging.getLogger("lnstrain").setLevel(own_level if rank == 0 else logging.WARNING)
    if not verbose:  # DeepSpeed's ZeRO calls it; nothing a user can act on
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def configure_threads(local_world_size: int) -> None:
    """An explicit ``OMP_NUM_THREADS`` is respected (torchrun sets 1 itself when it starts several
    ranks per node); without it, a CPU-only rank takes ``cores / local ranks`` threads."""
    import torch

    if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))


def ranks_on_this_machine(world_size: int) -> int:
    """The ranks on this machine, as torchrun (``LOCAL_WORLD_SIZE``) or DeepSpeed (``LOCAL_SIZE``) says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size)


def cpu_threads_per_rank(local_world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def init_distributed(timeout_minutes: float, verbose: bool) -> None:
    """Start the default process group; a plain ``python`` launch becomes a one-rank world. A
    collective that waits longer than ``timeout_minutes`` raises (``train.collective_timeout_minutes``).
    A rendezvous port in use stops this rank with a one-line error (exit 2)."""
    if "RANK" not in os.environ:
        from lnstrain.parallel.local_ranks import single_rank_env

        os.environ.update(single_rank_env())
    import torch

    from lnstrain.parallel.deepspeed_comm import init_deepspeed_comm, name_cpu_accelerator_if_no_cuda

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    logger.info("starting torch.distributed (%s, %d rank(s), rendezvous at %s)%s", backend, world_size, address,
                "; waiting for every rank" if world_size > 1 else "")
    name_cpu_accelerator_if_no_cuda()  # before DeepSpeed's first import, which would warn otherwise
    if verbose:
        from lnstrain.deepspeed_adapter import set_log_level

        set_log_level("info")
    try:
        init_deepspeed_comm(backend, datetime.timedelta(minutes=timeout_minutes))
    except RuntimeError as error:  # torch's DistNetworkError
        if "EADDRINUSE" not in str(error) and "address already in use" not in str(error).lower():
            raise
        tell(f"lnstrain: the rendezvous port {address} (MASTER_PORT) is already in use, probably by another "
             "job; pass a free one to the launcher: deepspeed --master_port PORT ... (torchrun: --master-port "
             "PORT)")
        sys.exit(EXIT_BAD_CONFIG)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def main(argv: list[str] | None = None) -> int:
    """Run ``launch`` and turn a Ctrl-C outside the training loop (which handles its own) into one
    line from rank 0 and exit 130, instead of a traceback on every rank."""
    guard_console()  # a console that goes away (tee killed by the Ctrl-C, a full disk) costs nothing
    rerun = resume_command(sys.argv if argv is None else [sys.argv[0], *argv])  # before the environment changes
    try:
        return launch(argv, rerun)
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:
            tell(f"\nlnstrain: interrupted (Ctrl-C) outside the training loop, so no trained step was lost; to "
                 f"continue, rerun: {rerun}")
        return EXIT_INTERRUPTED
    finally:
        RUN_LOG.close()


def launch(argv: list[str] | None, rerun: str) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    overrides += ["checkpoint.allow_pickle=true"] if args.allow_pickle else []
    overrides += ["checkpoint.allow_unverified=true"] if args.allow_unverified else []
    if args.dry_run:
        try:
            dry_run(args, overrides, world_size)
        except ConfigError as error:
            fail(error.problems, args.config)
        return 0
    configure_logging(rank, args.verbose)
    logger.info("checking %s: config, data, tokenizer, output directories", args.config)
    try:
        from lnstrain.config.run_config import read_config_file  # imports torch: seconds on a cold file system

        typed = read_config_file(args.config, overrides)
        finished_at = None if typed.problems else already_finished(typed.value)
        if finished_at is not None:
            logger.info("run '%s' already finished at step %d (%s); nothing to do", typed.value.run.name,
                        finished_at, typed.value.run.dir)
            return EXIT_FINISHED
        from lnstrain.training.preflight import run_problems

        local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
        problems = run_problems(typed, world_size, local_rank, rank, ranks_on_this_machine(world_size))
    except ConfigError as error:
        fail_on_every_rank(error.problems, args.config, rank, world_size)
    if problems:
        fail_on_every_rank(problems, args.config, rank, world_size)
    config = typed.value

    RUN_LOG.open(config.run.dir, rank, " ".join(sys.argv if argv is None else [sys.argv[0], *argv]))
    logger.info("run directory %s; checkpoints in %s (this launch's lines also in %s)", config.run.dir,
                config.checkpoint_dir, RUN_LOG.path or "no log file")
    configure_threads(ranks_on_this_machine(world_size))
    init_distributed(config.train.collective_timeout_minutes, args.verbose)
    from lnstrain.checkpoint.errors import CheckpointError
    from lnstrain.checkpoint.write_errors import CheckpointWriteError
    from lnstrain.data.token_check import TokenIdError
    from lnstrain.training.run_lock import RunDirectoryInUse
    from lnstrain.training.trainer import pretrain

    try:
        result = pretrain(config, stop_at_step=args.stop_at_step)
    except CheckpointWriteError as error:  # says where, why, the free space and what to do: no traceback
        logger.debug("the failed save", exc_info=True)
        if rank == 0 or not error.agreed:  # an agreed failure: every rank holds the same message
            tell(f"lnstrain: {error}")
        return EXIT_SAVE_FAILED
    except CheckpointError as error:  # no checkpoint to resume verifies, or one is unsafe: every rank agrees
        logger.debug("the refusal", exc_info=True)
        if rank == 0 or not error.agreed:  # an agreed refusal: every rank holds the same message
            tell(f"lnstrain: {error}")
        sys.exit(EXIT_BAD_CONFIG)
    except TokenIdError as error:  # a token file changed under the run: its rank stops, the launcher stops the rest
        tell(f"lnstrain: rank {rank}: {error}")
        return EXIT_FAILED
    except RunDirectoryInUse as error:  # another trainer runs on this run directory: every rank stops
        if rank == 0:
            tell(f"lnstrain: nothing was started: {error}")
        sys.exit(EXIT_BAD_CONFIG)
    logger.info("done (%s) at step %d, %d tokens seen%s", result.stop_reason, result.position.step,
                result.position.tokens_seen, f"; last checkpoint {result.last_checkpoint}" if result.last_checkpoint else "")
    if config.logging.tensorboard:
        logger.info("TensorBoard: tensorboard --logdir %s", config.run.dir / TENSORBOARD_DIR)
    if result.exit_code == EXIT_STOPPED and rank == 0:
        tell(f"lnstrain: stopped to be resumed after step {result.position.step} of {config.total_steps} "
             f"({result.stop_reason}){f'; checkpoint {result.last_checkpoint}' if result.last_checkpoint else ''}; "
             f"to continue, rerun: {rerun}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # a launcher stops the other ranks once one exits non-zero: let all finish first
        dist.destroy_process_group()
    return result.exit_code  # 0 finished, 75 stopped to be resumed, 3 stopped by non-finite losses


if __name__ == "__main__":
    sys.exit(main())
