"""The stop decisions: signals, the wall-clock limit (``train.exit_after_minutes``), time-based saves."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lnstrain.checkpoint.manager import read_latest
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED
from lnstrain.training.signals import StopController


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sigusr1_and_sigterm_only_set_a_flag_until_polled():
    previous = signal.getsignal(signal.SIGUSR1)
    clock = FakeClock()
    stop = StopController(None, None, clock=clock).install()
    try:
        assert not stop.poll(last_step_s=0.1, last_save_time=clock.now).stop
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
        decision = stop.poll(last_step_s=0.1, last_save_time=clock.now)
        assert decision.stop and decision.reason == "received SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_a_first_ctrl_c_stops_at_the_step_boundary_and_a_second_at_once():
    """Ctrl-C from a terminal reaches the launcher too, which sends SIGTERM: that is not a second Ctrl-C."""
    clock = FakeClock()
    at_once: list[bool] = []
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a background job
    stop = StopController(None, None, clock=clock, on_second_interrupt=lambda: at_once.append(True)).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # a KeyboardInterrupt without the handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert not at_once
        decision = stop.poll(last_step_s=0.1, last_save_time=clock.now)
        assert decision.stop and decision.reason == "received SIGINT"
        os.kill(os.getpid(), signal.SIGINT)
        assert at_once == [True]
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_wallclock_limit_leaves_room_for_the_slowest_step_and_save():
    clock = FakeClock()  # stands still: only the slowest step and save count here
    stop = StopController(exit_after_minutes=1.0, save_interval_minutes=None, clock=clock)
    assert not stop.poll(last_step_s=20.0, last_save_time=clock.now).stop
    stop.record_save(30.0)  # 20 s step + 30 s save + elapsed >= 60 s is not yet true...
    assert not stop.poll(last_step_s=1.0, last_save_time=clock.now).stop
    stop.record_save(45.0)  # ...but 20 + 45 is over the minute: stop now, while a save still fits
    decision = stop.poll(last_step_s=1.0, last_save_time=clock.now)
    assert decision.stop and decision.reason == "train.exit_after_minutes reached"


def test_wallclock_limit_counts_the_time_since_the_start():
    clock = FakeClock()
    stop = StopController(exit_after_minutes=1.0, save_interval_minutes=None, clock=clock)
    stop.record_save(30.0)
    clock.now += 9.0  # 9 s elapsed + 20 s slowest step + 30 s slowest save: 59 s, under the minute...
    assert not stop.poll(last_step_s=20.0, last_save_time=clock.now).stop
    clock.now += 1.0  # ...60 s is not
    decision = stop.poll(last_step_s=1.0, last_save_time=clock.now)
    assert decision.stop and decision.reason == "train.exit_after_minutes reached"


def test_time_based_save_is_due_after_the_interval():
    clock = FakeClock()
    stop = StopController(None, save_interval_minutes=1.0, clock=clock)
    last_save = clock.now
    clock.now += 59.0
    assert not stop.poll(1.0, last_save_time=last_save).save_for_time
    clock.now += 1.0
    decision = stop.poll(1.0, last_save_time=last_save)
    assert decision.save_for_time and not decision.stop


def stop_by_time(rank: int, world_size: int, corpus, root: Path) -> tuple:
    from lnstrain.training.trainer import pretrain

    # 6 ms after the trainer starts: already past when the first step ends (building the engine takes longer)
    overrides = tiny_run_overrides(corpus, root) + ["train.exit_after_minutes=0.0001", "checkpoint.interval_steps=0"]
    result = pretrain(load_config(TINY_RUN_CONFIG, overrides, world_size))
    return result.stop_reason, result.exit_code, sorted(result.losses), Path(result.last_checkpoint).name


@pytest.mark.multirank
def test_exit_after_minutes_saves_and_stops_every_rank_after_the_same_step(tiny_corpus, tmp_path):
    results = run_distributed(stop_by_time, 2, tiny_corpus, tmp_path, timeout_s=240)
    assert results[0] == results[1], results
    assert results[0] == ("train.exit_after_minutes reached", EXIT_STOPPED, [1], "global_step1"), results
    assert read_latest(tmp_path / "tiny" / "checkpoints").name == "global_step1"
