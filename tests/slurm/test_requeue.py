"""Runs outlive their jobs, proven on a real one-node SLURM (``lnstrain.testing.local_slurm``).

Every job is a 2-rank run of the tiny model submitted the way users submit it:
``launch/slurm/make_sbatch.py --submit`` writes ``<run dir>/job.sbatch`` (per_node mode: srun, the
DeepSpeed launcher under ``preemptible.py``) and submits it. The interruptions are real:
``scancel --signal=USR1`` is what SLURM sends ``signal_seconds`` before the time limit (asking for
it by hand keeps the test short and independent of timing), a rank SIGKILLed in the middle of a save
is a crash, and ``scontrol requeue`` on a job paused in the middle of a save is what a preemption with
``PreemptMode=REQUEUE`` does. Every run's loss curve (TensorBoard, one point per step) is compared
with an uninterrupted 2-rank run in this process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lnstrain.checkpoint.manager import read_latest
from lnstrain.checkpoint.save_points import KILL_AT_ENV, PAUSE_AT_ENV
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.local_slurm import LocalSlurm
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.outcome import EXIT_STOPPED

pytestmark = [pytest.mark.slurm, pytest.mark.multirank, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
RUN = [f"train.steps={STEPS}", "checkpoint.interval_steps=10", "train.eval_interval=0", "logging.interval=1",
       "logging.tensorboard=true"]
TOLERANCE = 1e-6 + 5e-7  # the runs' own tolerance plus TensorBoard's fp32 scalars
IN_SECOND_SAVE = "1:9"  # rank 1, save point 9: in the middle of DeepSpeed's files of the step-20 save
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
JOB_TIMEOUT_S = 360


def uninterrupted(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict[int, float]:
    from lnstrain.training.trainer import pretrain

    config = load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root) + RUN, world_size)
    return pretrain(config).losses


@pytest.fixture(scope="module")
def straight(local_slurm, tiny_corpus, tmp_path_factory) -> dict[int, float]:
    return run_distributed(uninterrupted, 2, tiny_corpus, tmp_path_factory.mktemp("straight"), timeout_s=300)[0]


class Run:
    """One run directory: its config, its cluster profile, the jobs that train it and what they left."""

    def __init__(self, slurm: LocalSlurm, corpus: TinyCorpus, root: Path, **slurm_options) -> None:
        self.slurm, self.root, self.dir = slurm, root, root / "runs" / "tiny"
        load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, root / "runs") + RUN, 2).save(root / "tiny.yaml")
        profile = {"name": "local", "launcher": "slurm", "gpus_per_node": 2, "python": sys.executable,
                   "env": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                   "slurm": {"mode": "per_node", "time": "00:10:00", "signal_seconds": 60, "cpus_per_task": 1,
                             **slurm_options}}
        (root / "cluster.yaml").write_text(yaml.safe_dump(profile))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = self.slurm.env | (extra or {})  # sbatch hands this environment to the job
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the `deepspeed` beside python
        return env

    def submit(self, extra_env: dict[str, str] | None = None) -> list[str]:
        command = [sys.executable, str(REPO / "launch" / "slurm" / "make_sbatch.py"), "--config",
                   str(self.root / "tiny.yaml"), "--gpus", "2", "--cluster", str(self.root / "cluster.yaml"), "--submit"]
        done = subprocess.run(command, capture_output=True, text=True, env=self.env(extra_env), cwd=self.root,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return re.search(r"jobs? ([\d ]+?)(?: \(|;)", done.stdout).group(1).split()

    def sbatch(self, *args: str) -> str:
        return self.slurm.run("sbatch", "--parsable", f"--output={self.root}/other-%j.out", *args).strip()

    def output(self, job_id: str) -> str:
        path = self.dir / f"slurm-{job_id}.out"
        return path.read_text(errors="replace") if path.is_file() else ""

    def wait_for_line(self, job_id: str, pattern: str) -> re.Match:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            match = re.search(pattern, self.output(job_id))
            if match:
                return match
            state = self.slurm.job(job_id).get("JobState")
            if state in ENDED or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} ({state}) printed no line matching {pattern!r}:\n"
                                     + self.output(job_id)[-4000:] + self.slurm.log_tail())
            time.sleep(0.2)

    def wait_until_ended(self, job_id: str) -> dict[str, str]:
        return self.slurm.wait_for(job_id, ENDED, JOB_TIMEOUT_S)

    def jobs_log(self) -> list[str]:
        return (self.dir / "slurm_jobs.log").read_text().splitlines()

    def training_files(self) -> dict[Path, int]:
        """What the training wrote (not the job's output, hostfile or jobs log), with modification times."""
        return {p: p.stat().st_mtime_ns for p in self.dir.rglob("*")
                if p.is_file() and not p.name.startswith(("slurm", "hostfile."))}

    def event_files(self) -> list[Path]:
        return sorted((self.dir / "tensorboard").glob("events.out.tfevents.*"))

    def loss_points(self) -> dict[int, list[float]]:
        """Every ``train/loss`` point written, per step, oldest event file first."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        points: dict[int, list[float]] = {}
        for path in sorted(self.event_files(), key=lambda p: p.stat().st_mtime_ns):
            events = EventAccumulator(str(path), size_guidance={"scalars": 0}).Reload()
            for event in events.Scalars("train/loss") if "train/loss" in events.Tags()["scalars"] else []:
                points.setdefault(event.step, []).append(event.value)
        return points


def assert_curve(run: Run, straight: dict[int, float], once: bool) -> None:
    """Every step's loss equals the uninterrupted run's (the last point written for it; ``once``:
    exactly one point per step: no step trained twice, none missing)."""
    points = run.loss_points()
    assert sorted(points) == list(range(1, STEPS + 1)), sorted(points)
    if once:
        assert all(len(values) == 1 for values in points.values()), {s: v for s, v in points.items() if len(v) > 1}
    for step, values in points.items():
        assert abs(values[-1] - straight[step]) <= TOLERANCE, (step, values, straight[step])


def test_warning_signal_requeues_the_job_and_the_run_resumes_to_its_last_step(local_slurm, tiny_corpus, straight,
                                                                               tmp_path):
    run = Run(local_slurm, tiny_corpus, tmp_path)
    [job] = run.submit()
    after_ok = run.sbatch(f"--dependency=afterok:{job}", "--wrap", "true")
    run.wait_for_line(job, r"step 3/40 \|")
    local_slurm.run("scancel", "--signal=USR1", job)  # what SLURM sends signal_seconds before the time limit
    stopped_at = int(run.wait_for_line(job, r"stopping after step (\d+): received SIGUSR1").group(1))
    run.wait_for_line(job, rf"job {job} restart 0: run stopped before its last step; requeueing it "
                           r"\(restart 1 of at most 50\)")
    assert local_slurm.job(after_ok)["JobState"] == "PENDING"  # afterok: the run is not finished
    ended = run.wait_until_ended(job)

    assert (ended["JobState"], ended["Restarts"], ended["ExitCode"]) == ("COMPLETED", "1", "0:0"), ended
    records = [r["JobState"] for r in local_slurm.completions() if r["JobId"] == job]
    assert len(records) == 2 and records[-1] == "COMPLETED" and "COMPLETED" not in records[:-1], records
    assert run.jobs_log() == [f"{job} restart=0 exit={EXIT_STOPPED}", f"{job} restart=1 exit=0"]
    assert f"job {job} restart 1: run 'tiny' resumes from global_step{stopped_at}" in run.output(job)
    assert 3 <= stopped_at < STEPS
    assert_curve(run, straight, once=True)
    assert local_slurm.wait_for(after_ok, ENDED, 120)["JobState"] == "COMPLETED"


def test_a_crash_is_not_requeued_and_a_resubmission_resumes_from_the_last_complete_checkpoint(
        local_slurm, tiny_corpus, straight, tmp_path):
    run = Run(local_slurm, tiny_corpus, tmp_path)
    [job] = run.submit({KILL_AT_ENV: IN_SECOND_SAVE})
    after_ok = run.sbatch(f"--dependency=afterok:{job}", "--wrap", "true")
    after_any = run.sbatch(f"--dependency=afterany:{job}", "--wrap", "true")
    ended = run.wait_until_ended(job)

    assert (ended["JobState"], ended["Restarts"]) == ("FAILED", "0"), ended
    [line] = run.jobs_log()
    assert int(line.split("exit=")[1]) not in (0, EXIT_STOPPED), line
    assert "killing this process at save point 9" in run.output(job) and "requeueing" not in run.output(job)
    assert read_latest(run.dir / "checkpoints").name == "global_step10"
    assert local_slurm.wait_for(after_any, ENDED, 120)["JobState"] == "COMPLETED"
    deadline = time.monotonic() + 60
    while local_slurm.job(after_ok).get("Reason") != "DependencyNeverSatisfied" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert local_slurm.job(after_ok)["Reason"] == "DependencyNeverSatisfied", local_slurm.job(after_ok)
    local_slurm.run("scancel", after_ok)

    again = local_slurm.run("sbatch", "--parsable", str(run.dir / "job.sbatch"), env=run.env()).strip()  # by hand
    assert run.wait_until_ended(again)["JobState"] == "COMPLETED"
    assert f"job {again} restart 0: run 'tiny' resumes from global_step10" in run.output(again)
    assert_curve(run, straight, once=False)  # steps 11..20 were logged before the crash too


def test_a_preemption_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint(local_slurm, tiny_corpus,
                                                                                   straight, tmp_path):
    run = Run(local_slurm, tiny_corpus, tmp_path,  # only the first job pauses in its save
              setup=[f'[[ "${{SLURM_RESTART_COUNT:-0}}" == 0 ]] || unset {PAUSE_AT_ENV}'])
    [job] = run.submit({PAUSE_AT_ENV: IN_SECOND_SAVE})
    run.wait_for_line(job, r"pausing this process at save point 9")
    local_slurm.run("scontrol", "requeue", job)  # what a preemption with PreemptMode=REQUEUE does
    ended = run.wait_until_ended(job)

    assert (ended["JobState"], ended["Restarts"], ended["ExitCode"]) == ("COMPLETED", "1", "0:0"), ended
    assert f"job {job} restart 1: run 'tiny' resumes from global_step10" in run.output(job)
    assert run.jobs_log()[-1] == f"{job} restart=1 exit=0"
    assert_curve(run, straight, once=False)  # steps 11..20 were logged before the preemption too


def test_a_chain_without_requeue_resumes_in_the_next_link_and_a_finished_run_ends_the_chain(
        local_slurm, tiny_corpus, straight, tmp_path):
    run = Run(local_slurm, tiny_corpus, tmp_path, requeue=False, chain_jobs=3)
    first, second, third = run.submit()
    run.wait_for_line(first, r"step 3/40 \|")
    local_slurm.run("scancel", "--signal=USR1", first)
    ended = run.wait_until_ended(first)
    assert (ended["JobState"], ended["Restarts"], ended["ExitCode"]) == ("FAILED", "0", f"{EXIT_STOPPED}:0"), ended
    assert run.wait_until_ended(second)["JobState"] == "COMPLETED"
    files = run.training_files()
    assert run.wait_until_ended(third)["JobState"] == "COMPLETED"

    assert "(chain link 1/3): run stopped before its last step" in run.output(first)
    assert "run 'tiny' already finished at step 40" in run.output(third)
    assert run.training_files() == files  # the last link trained, evaluated and logged nothing
    assert run.jobs_log() == [f"{first} restart=0 exit={EXIT_STOPPED}", f"{second} restart=0 exit=0",
                              f"{third} restart=0 exit=0"]
    assert_curve(run, straight, once=True)
