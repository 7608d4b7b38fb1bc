"""Stopping and time-based saving that every rank agrees on.

SIGTERM (a scheduler's warning before the kill), SIGUSR1 (a user's "save and stop") and a first
SIGINT (Ctrl-C) only set a flag; the training loop asks ``poll()`` after each step, which all-reduces
the local flags over the world, so either every rank stops after the same step or none does. A second
SIGINT stops this rank at once (exit 130, no traceback): the newest complete checkpoint stays, since
a save survives a kill at any moment. A terminal's Ctrl-C reaches every process of its foreground
group, and the DeepSpeed launcher then sends SIGTERM as well: only a second SIGINT counts as "again". The wall-clock limit
(``train.exit_after_minutes``, Megatron-LM's ``--exit-duration-in-mins``) and the time-based checkpoint interval go through the same
all-reduce, because clocks on different ranks disagree by a little.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lnstrain.training.outcome import EXIT_INTERRUPTED

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def stop_at_once() -> None:
    """A second Ctrl-C: one line (from rank 0), then exit 130 without unwinding (nothing to save)."""
    if _rank() == 0:
        logger.warning("second Ctrl-C: stopped at once; the newest complete checkpoint is kept, and rerunning the "
                       "same command resumes from it")
    logging.shutdown()
    os._exit(EXIT_INTERRUPTED)


@dataclass
class LoopDecision:
    """What every rank does after the current step."""

    stop: bool = False
    reason: str = ""
    save_for_time: bool = False


class StopController:
    """Installs the signal handlers and decides, collectively, when to stop or save.

    Args:
        exit_after_minutes: stop (and save) before this much time has passed since ``started``; the
            margin is the slowest step plus the slowest save seen so far (twice while a save is being
            written in the background: the stop waits for it, then saves).
        save_interval_minutes: ask for a save when this much time passed since ``last_save_time``.
        device: where the flags live for the all-reduce (the accelerator with NCCL).
        started: ``clock()`` when the clock of ``exit_after_minutes`` started (default: now).
        clock: seconds on a clock that never goes back, as ``last_save_time`` and ``started`` are given.
        on_second_interrupt: what a second SIGINT does (default ``stop_at_once``).
    """

    def __init__(self, exit_after_minutes: float | None, save_interval_minutes: float | None,
                 device: torch.device | str = "cpu", started: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_second_interrupt: Callable[[], None] = stop_at_once) -> None:
        self.device = torch.device(device)
        self.clock = clock
        self.started = clock() if started is None else started
        self.deadline_s = None if exit_after_minutes is None else 60.0 * exit_after_minutes
        self.save_interval_s = None if save_interval_minutes is None else 60.0 * save_interval_minutes
        self.received: int | None = None
        self.interrupted = False
        self.on_second_interrupt = on_second_interrupt
        self.slowest_step_s = 0.0
        self.slowest_save_s = 0.0
        self._previous_handlers: dict[int, object] = {}

    def install(self) -> "StopController":
        for signum in STOP_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                self.on_second_interrupt()
                return
            self.interrupted = True
            if _rank() == 0:
                logger.info("Ctrl-C: saving after the current step, then stopping (Ctrl-C again stops at once)")
        if self.received is None:
            self.received = signum  # only a flag: the loop acts on it between steps

    def poll(self, last_step_s: float, last_save_time: float, save_in_flight: bool = False) -> LoopDecision:
        """Collective: every rank calls it after each step and gets the same decision.
        ``save_in_flight``: a save's files are being written in the background (the same on every rank)."""
        now = self.clock()
        self.slowest_step_s = max(self.slowest_step_s, last_step_s)
        saves_s = self.slowest_save_s * (2 if save_in_flight else 1)
        out_of_time = (self.deadline_s is not None and
                       now - self.started + self.slowest_step_s + saves_s >= self.deadline_s)
        save_due = self.save_interval_s is not None and now - last_save_time >= self.save_interval_s
        flags = torch.tensor([self.received is not None, out_of_time, save_due], dtype=torch.int32,
                             device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, out_of_time, save_due = (bool(v) for v in flags.tolist())
        if signalled:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            return LoopDecision(stop=True, reason=f"received {name}", save_for_time=save_due)
        if out_of_time:
            return LoopDecision(stop=True, reason="train.exit_after_minutes reached", save_for_time=save_due)
        return LoopDecision(save_for_time=save_due)

    def record_save(self, seconds: float) -> None:
        self.slowest_save_s = max(self.slowest_save_s, seconds)
