"""Stack dumps (``lnstrain.training.stack_dumps``): SIGUSR2 and a slow loop iteration write every
thread's Python stack to the rank's stderr, and training goes on unchanged."""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides
from lnstrain.training.stack_dumps import DUMP_SIGNAL, WATCH_THREAD_NAME, StackDumps

HEADER = "(most recent call first)"  # faulthandler's, on a signal
TIMED_HEADER = "the Python stack of every thread"  # the slow-iteration watch's


def _a_waiting_thread(release: threading.Event) -> None:
    release.wait(30)


def test_sigusr2_writes_the_stack_of_every_thread_and_the_process_goes_on(tmp_path):
    release = threading.Event()
    helper = threading.Thread(target=_a_waiting_thread, args=(release,), daemon=True)
    helper.start()
    with open(tmp_path / "stderr.txt", "w+") as stream:
        dumps = StackDumps(after_minutes=None, stream=stream).install()
        try:
            os.kill(os.getpid(), DUMP_SIGNAL)  # would end the process without the handler
            time.sleep(0.1)  # the dump is written by the signal handler, in C, on its own
        finally:
            dumps.uninstall()
            release.set()
        stream.seek(0)
        text = stream.read()
    assert text.count(HEADER) >= 2, text  # this thread and the helper
    assert "_a_waiting_thread" in text and "test_sigusr2_writes_the_stack_of_every_thread" in text
    assert not faulthandler.unregister(DUMP_SIGNAL)  # uninstall took the handler away again


class _Clock:
    """The watch's clock, moved by the test: no dump depends on how fast the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _a_slow_iteration(dumps: StackDumps, clock: _Clock, seconds: float) -> None:
    clock.now += seconds
    dumps._watch.look()  # the watch writes every dump due by now before this returns


def test_a_slow_iteration_logs_stacks_until_the_next_one_starts(caplog):
    caplog.set_level(logging.WARNING, logger="lnstrain.training.stack_dumps")
    clock = _Clock()
    dumps = StackDumps(after_minutes=1.0, clock=clock).install()
    try:
        dumps.iteration_started(7)
        _a_slow_iteration(dumps, clock, 59.0)
        assert not caplog.records  # under a minute: nothing yet
        _a_slow_iteration(dumps, clock, 2.0)  # 61 s: the first dump
        _a_slow_iteration(dumps, clock, 120.0)  # 181 s: two more, at 120 s and 180 s
        written = [r.getMessage() for r in caplog.records]
        dumps.iteration_started(8)  # re-armed: the next dump is a minute away again
        _a_slow_iteration(dumps, clock, 59.0)
        assert len(caplog.records) == 3
        _a_slow_iteration(dumps, clock, 1.0)
        [eighth] = [r.getMessage() for r in caplog.records[3:]]
    finally:
        dumps.uninstall()
    assert len(written) == 3, written
    assert [m.split(" has run for ")[1].split(" min")[0] for m in written] == ["1.02", "3.02", "3.02"]
    assert all(TIMED_HEADER in m and "step 7" in m and "_a_slow_iteration" in m for m in written), written[0]
    assert "the loop iteration of step 8 has run for 1.00 min" in eighth
    assert not any(WATCH_THREAD_NAME in t.name for t in threading.enumerate())  # uninstalled: no watch left


CHURN = """
import logging, sys, threading, time
from lnstrain.training.stack_dumps import StackDumps
dumped = []
class Count(logging.Handler):
    def emit(self, record):
        dumped.append(1)
logging.getLogger("lnstrain.training.stack_dumps").addHandler(Count(level=logging.WARNING))
dumps = StackDumps(after_minutes=0.001 / 60).install()  # a dump every millisecond
dumps.iteration_started(1)
def work():
    sum(range(1000))
give_up = time.monotonic() + 300
while len(dumped) < 200 and time.monotonic() < give_up:  # threads start and end all the time, as checkpoint writers do
    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
dumps.uninstall()
print(f"survived {len(dumped)} dumps")
"""


def test_timed_dumps_survive_threads_that_start_and_end_meanwhile():
    # faulthandler.dump_traceback_later, which the watch replaced, ends this with a segfault within seconds
    done = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr[-3000:])
    assert int(done.stdout.split()[1]) >= 200, done.stdout  # the churn lasted until 200 dumps were written


def test_stack_dump_after_minutes_must_be_positive():
    from lnstrain.training.config import TrainConfig

    problems = TrainConfig(steps=1, stack_dump_after_minutes=0).validate()
    assert any("train.stack_dump_after_minutes must be > 0" in p for p in problems), problems


def train_and_read_stderr(rank: int, world_size: int, corpus, root: Path, after_minutes: float | None):
    from lnstrain.training.trainer import pretrain

    root.mkdir(parents=True, exist_ok=True)
    log = root / f"stderr_rank{rank}.txt"
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 2)  # this rank's stderr, where the dumps go
    overrides = tiny_run_overrides(corpus, root)
    if after_minutes is not None:
        overrides.append(f"train.stack_dump_after_minutes={after_minutes}")
    result = pretrain(load_config(TINY_RUN_CONFIG, overrides, world_size))
    return sorted(result.losses.items()), log.read_text(errors="replace"), os.getpid()


@pytest.mark.multirank
def test_timed_dumps_show_each_rank_inside_the_training_loop_and_change_no_loss(tiny_corpus, tmp_path):
    plain = run_distributed(train_and_read_stderr, 2, tiny_corpus, tmp_path / "plain", None, timeout_s=240)
    dumped = run_distributed(train_and_read_stderr, 2, tiny_corpus, tmp_path / "dumped", 0.02 / 60,
                             timeout_s=240)
    for rank in (0, 1):
        assert dumped[rank][0] == plain[rank][0]  # the same losses, bit for bit
        assert TIMED_HEADER not in plain[rank][1]
        stacks = dumped[rank][1]
        assert TIMED_HEADER in stacks and "lnstrain/training/trainer.py" in stacks, stacks[-2000:]
    rank0_log = plain[0][1]  # names every rank's PID, to signal
    assert f"rank:pid on {socket.gethostname()} 0:{plain[0][2]} 1:{plain[1][2]}" in rank0_log, rank0_log[:3000]


def wait_in_a_collective_and_collect_dumps(rank: int, world_size: int, exchange: Path) -> list[str]:
    import torch.distributed as dist

    messages: list[str] = []
    early_count = exchange / "rank0_dumps"

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())
            if rank == 0:
                early_count.write_text(str(len(messages)))

    watched = logging.getLogger("lnstrain.training.stack_dumps")
    watched.addHandler(Keep(level=logging.WARNING))
    dist.barrier()
    dumps = StackDumps(after_minutes=0.1 / 60).install()
    try:
        dumps.iteration_started(5)
        if rank == 1:
            _wait_for_the_early_rank(messages, early_count)  # rank 0 waits for it inside the barrier
        dist.barrier()
    finally:
        dumps.uninstall()
    return messages


def _wait_for_the_early_rank(own: list[str], early_count: Path) -> None:
    """Hold back until rank 0 has written three dumps from inside the barrier and this rank one of its own
    (a file says how many rank 0 has: the ranks share nothing else while one waits in a collective)."""
    give_up = time.monotonic() + 300
    while time.monotonic() < give_up:
        if own and early_count.exists() and int(early_count.read_text() or 0) >= 3:
            return
        time.sleep(0.05)


@pytest.mark.multirank
def test_a_rank_waiting_in_a_collective_still_writes_its_timed_dumps(tmp_path):
    early, late = run_distributed(wait_in_a_collective_and_collect_dumps, 2, tmp_path, timeout_s=400)
    assert len(early) >= 3, early
    assert all("step 5" in m and "in barrier" in m for m in early), early[0]
    assert late and all("_wait_for_the_early_rank" in m and "in barrier" not in m for m in late), late[0]
