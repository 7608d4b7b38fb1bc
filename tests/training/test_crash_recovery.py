"""Two ranks under the DeepSpeed launcher, as users run them: crashes and preemption, then the same
command again, and the losses equal the uninterrupted run's.

One run directory goes through four launches:
  1. rank 1 SIGKILLs itself in the middle of the second save (the save-point hook): the job exits
     (the survivor's collective fails at once, the launcher stops it), ``latest`` still names step 2;
  2. the same command resumes from step 2; once step 4 is saved the test SIGKILLs rank 1's PID;
  3. the same command through ``launch/slurm/preemptible.py``; SIGTERM to the wrapper makes every
     rank save and stop, and the launcher and the wrapper exit 75 (stopped to be resumed);
  4. the same command finishes the run (exit 0);
  5. the same command again says "already finished" and writes nothing.
Every step's loss (TensorBoard, the last value written for it) equals the uninterrupted run's.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lnstrain.checkpoint.manager import read_latest
from lnstrain.checkpoint.metadata import is_complete
from lnstrain.checkpoint.save_points import KILL_AT_ENV
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import free_port, run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED
from tests.training.test_launch import LAUNCHER, REPO, launcher_env

RUN = ["train.steps=8", "checkpoint.interval_steps=2", "train.eval_interval=0", "logging.tensorboard=true"]
TOLERANCE = 1e-6
HUNG_AFTER_S = 120  # a launch still running this long after it should have ended is hung
RANK1_SECOND_SAVE_DEEPSPEED_FILE = "1:9"  # rank 1's points per save: start, file before/after, RNG, fsync, barrier


def uninterrupted(rank: int, world_size: int, corpus: TinyCorpus, root: Path):
    from lnstrain.training.trainer import pretrain

    return pretrain(load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root) + RUN, world_size))


def deepspeed_command(corpus: TinyCorpus, root: Path) -> list[str]:
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()),
               str(LAUNCHER), "--config", str(TINY_RUN_CONFIG)]
    for override in tiny_run_overrides(corpus, root) + RUN:
        command += ["--set", override]
    return command


def tensorboard_losses(directory: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses: dict[int, float] = {}
    for events_file in sorted(directory.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        events = EventAccumulator(str(events_file), size_guidance={"scalars": 0}).Reload()
        if "train/loss" in events.Tags()["scalars"]:
            losses.update({e.step: e.value for e in events.Scalars("train/loss")})
    return losses


class Launch:
    """A launch whose output is read line by line; ``until(pattern)`` waits for a line."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(command, cwd=REPO, env=launcher_env() | (env or {}), text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []

    def until(self, pattern: str) -> re.Match:
        for line in self.process.stdout:
            self.lines.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(self.lines[-60:]))

    def finish(self, hung_after_s: float) -> int:
        """The launch's exit status; a launch still running ``hung_after_s`` later fails the test."""
        try:
            self.lines += self.process.communicate(timeout=hung_after_s)[0].splitlines(keepends=True)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"still running {hung_after_s} s later:\n" + "".join(self.lines[-60:]))
        return self.process.returncode

    @property
    def text(self) -> str:
        return "".join(self.lines)


@pytest.mark.multirank
@pytest.mark.slow
def test_crash_and_preemption_under_the_deepspeed_launcher(tiny_corpus, tmp_path):
    [straight, _] = run_distributed(uninterrupted, 2, tiny_corpus, tmp_path / "straight", timeout_s=300)
    root = tmp_path / "crashy"
    checkpoints = root / "tiny" / "checkpoints"
    command = deepspeed_command(tiny_corpus, root)

    first = Launch(command, {KILL_AT_ENV: RANK1_SECOND_SAVE_DEEPSPEED_FILE})
    assert first.finish(120) != 0, first.text
    assert "killing this process at save point 9 (deepspeed file: written)" in first.text, first.text[-3000:]
    assert read_latest(checkpoints).name == "global_step2" and not is_complete(checkpoints / "global_step4")

    second = Launch(command)
    second.until(r"resumed from .*global_step2")
    rank0_pid, rank1_pid = (int(re.search(rf"process (\d+) spawned with command: .*--local_rank={rank}",
                                          second.text).group(1)) for rank in (0, 1))
    second.until(r"saved checkpoint .*global_step4")
    import os

    os.kill(rank1_pid, signal.SIGKILL)
    assert second.finish(HUNG_AFTER_S) != 0, second.text[-3000:]
    # the launcher saw rank 1 killed (-9) and stopped the survivor instead of leaving it in a collective
    assert f"exits with return code = -{int(signal.SIGKILL)}" in second.text, second.text[-3000:]
    assert f"Killing subprocess {rank0_pid}" in second.text, second.text[-3000:]
    assert read_latest(checkpoints).name in ("global_step4", "global_step6")

    preemptible = Launch([sys.executable, str(REPO / "launch" / "slurm" / "preemptible.py"), "--", *command])
    preemptible.until(r"resumed from .*global_step[46]")
    preemptible.until(r"step \d/8 \|")
    preemptible.process.send_signal(signal.SIGTERM)
    assert preemptible.finish(HUNG_AFTER_S) == EXIT_STOPPED, preemptible.text[-3000:]
    assert "received SIGUSR1" in preemptible.text and "stopping after step" in preemptible.text
    assert int(re.search(r"done \(received SIGUSR1\) at step (\d)", preemptible.text).group(1)) < 8

    last = Launch(command)
    assert last.finish(180) == 0, last.text[-3000:]
    final = json.loads((root / "tiny" / "final_metrics.json").read_text())
    assert final["step"] == 8 and abs(final["eval_loss"] - straight.eval_losses[8]) <= TOLERANCE, final

    losses = tensorboard_losses(root / "tiny" / "tensorboard")
    assert sorted(losses) == list(range(1, 9))
    for step, loss in losses.items():
        assert abs(loss - straight.losses[step]) <= TOLERANCE + 5e-7, (step, loss, straight.losses[step])  # fp32 scalars

    files_before = file_states(root)
    again = Launch(command)
    assert again.finish(180) == 0, again.text[-3000:]
    assert "run 'tiny' already finished at step 8" in again.text, again.text[-3000:]
    assert file_states(root) == files_before  # no new event file, checkpoint or final evaluation


def file_states(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}
