"""The stop decisions of one process: signals, the wall-clock limit, time-based saves."""

from __future__ import annotations

import os
import signal
import time

from lnstrain.training.signals import StopController


def test_sigusr1_and_sigterm_only_set_a_flag_until_polled():
    previous = signal.getsignal(signal.SIGUSR1)
    stop = StopController(None, None).install()
    try:
        assert not stop.poll(last_step_s=0.1, last_save_time=time.monotonic()).stop
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
        decision = stop.poll(last_step_s=0.1, last_save_time=time.monotonic())
        assert decision.stop and decision.reason == "received SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_wallclock_limit_leaves_room_for_the_slowest_step_and_save():
    stop = StopController(exit_after_minutes=1.0, save_interval_minutes=None)
    assert not stop.poll(last_step_s=20.0, last_save_time=time.monotonic()).stop
    stop.record_save(30.0)  # 20 s step + 30 s save + elapsed >= 60 s is not yet true...
    assert not stop.poll(last_step_s=1.0, last_save_time=time.monotonic()).stop
    stop.record_save(45.0)  # ...but 20 + 45 is over the minute: stop now, while a save still fits
    decision = stop.poll(last_step_s=1.0, last_save_time=time.monotonic())
    assert decision.stop and decision.reason == "train.exit_after_minutes reached"


def test_time_based_save_is_due_after_the_interval():
    stop = StopController(None, save_interval_minutes=1.0)
    assert not stop.poll(1.0, last_save_time=time.monotonic()).save_for_time
    decision = stop.poll(1.0, last_save_time=time.monotonic() - 61.0)
    assert decision.save_for_time and not decision.stop
