"""``run``: write each run's directory and resolved config, then launch what is not finished.

A run is *finished* when ``lnstrain.study.results.final_metrics`` finds its final evaluation; anything else is
launched again and resumes from its latest checkpoint (``checkpoint.resume: auto``). Launchers:
``local`` runs one after another here (``python`` for one process, ``deepspeed --num_gpus`` for
more); ``deepspeed`` runs them one after another with the cluster's hostfile; ``slurm`` writes
``<run dir>/job.sbatch`` and submits it, or a chain of ``slurm.chain_jobs`` (skipping runs whose job is
still queued, running or requeued); the job requeues itself until its run is finished.
A failed run is reported and the others still run.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lnstrain.no_follow import open_for_appending, write_text_replacing
from lnstrain.report_lines import escaped
from lnstrain.run_files import JOB_SCRIPT, LAUNCH_LOG, SLURM_JOB_ID_FILE, STUDY_CONFIG_FILE
from lnstrain.study.plan import PlannedRun
from lnstrain.study.results import final_metrics
from lnstrain.study.slurm import render_sbatch, submit
from lnstrain.study.spec import ClusterProfile, Study

logger = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LaunchResult:
    run: str
    status: str
    """``finished`` (skipped), ``completed``, ``failed``, ``submitted``, ``queued`` (skipped) or ``written``."""
    detail: str = ""


def run_status(run_dir: Path, checkpoint_dir: Path, total_steps: int) -> str:
    """``finished``, ``partial`` (checkpoints exist in ``checkpoint_dir``, the run's ``checkpoint_dir``
    wherever ``checkpoint.dir`` puts it: it will resume) or ``new``."""
    if final_metrics(run_dir, total_steps) is not None:
        return "finished"
    return "partial" if checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir()) else "new"


def training_command(config_path: Path, gpus: int, cluster: ClusterProfile) -> list[str]:
    """The command that trains one run on ``gpus`` accelerators with the cluster's launcher."""
    script = str(REPO_ROOT / "launch" / "pretrain.py")
    if cluster.launcher == "deepspeed":
        nodes = math.ceil(gpus / cluster.gpus_per_node)
        return ["deepspeed", "--hostfile", str(cluster.hostfile), "--num_nodes", str(nodes),
                "--num_gpus", str(min(gpus, cluster.gpus_per_node)), "--master_addr", cluster.master_addr,
                "--master_port", str(cluster.master_port), "--no_local_rank", script, "--config", str(config_path)]
    if gpus > cluster.gpus_per_node:
        raise ValueError(f"{gpus} GPUs do not fit one node of {cluster.gpus_per_node}; use launcher "
                         f"'deepspeed' or 'slurm' in the cluster profile")
    if gpus == 1:
        return [cluster.python, script, "--config", str(config_path)]
    return ["deepspeed", "--num_gpus", str(gpus), "--master_port", str(cluster.master_port), "--no_local_rank",
            script, "--config", str(config_path)]


def prepare_run_dir(planned: PlannedRun) -> Path:
    """Create the run directory and write the resolved config (layout included) into it."""
    config = planned.config
    config.run.dir.mkdir(parents=True, exist_ok=True)
    path = config.run.dir / STUDY_CONFIG_FILE
    config.save(path)
    return path


def _slurm_job_active(run_dir: Path) -> bool:
    job_file = run_dir / SLURM_JOB_ID_FILE
    if not job_file.is_file() or not shutil.which("squeue"):
        return False
    job_id = job_file.read_text().strip()
    result = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return result.returncode == 0 and bool(result.stdout.strip())


def _launch_slurm(study: Study, planned: PlannedRun, config_path: Path) -> LaunchResult:
    run_dir = planned.config.run.dir
    if _slurm_job_active(run_dir):
        return LaunchResult(planned.run.name, "queued", f"job {(run_dir / SLURM_JOB_ID_FILE).read_text().strip()}")
    script = run_dir / JOB_SCRIPT
    write_text_replacing(script, render_sbatch(planned.run.name, run_dir.resolve(), str(config_path.resolve()),
                                               planned.gpus, study.cluster, REPO_ROOT,
                                               planned.config.checkpoint_dir.resolve()))
    if not study.cluster.slurm.submit:
        return LaunchResult(planned.run.name, "written", str(script))
    try:
        job_ids = submit(script, study.cluster.slurm.chain_jobs)
    except (RuntimeError, FileNotFoundError) as error:
        return LaunchResult(planned.run.name, "failed", str(error))
    # the chain's last link: queued until the run ends
    write_text_replacing(run_dir / SLURM_JOB_ID_FILE, job_ids[-1] + "\n")
    return LaunchResult(planned.run.name, "submitted", f"job{'s' * (len(job_ids) > 1)} {' '.join(job_ids)}")


def _launch_here(study: Study, planned: PlannedRun, config_path: Path) -> LaunchResult:
    command = training_command(config_path, planned.gpus, study.cluster)
    log_path = planned.config.run.dir / LAUNCH_LOG
    logger.info("%s: %s (log %s)", planned.run.name, " ".join(command), log_path)
    env = {**os.environ, **study.cluster.env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        log = open_for_appending(log_path)  # never a planted link's target
    except OSError as error:
        return LaunchResult(planned.run.name, "failed", f"cannot write {escaped(log_path)}: {error.strerror or error}")
    with os.fdopen(log, "a", encoding="utf-8") as log_file:
        code = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, env=env).returncode
    if code == 0 and run_status(planned.config.run.dir, planned.config.checkpoint_dir, planned.config.total_steps) == "finished":
        return LaunchResult(planned.run.name, "completed")
    return LaunchResult(planned.run.name, "failed", f"exit code {code}; see {log_path}")


def launch_study(study: Study, planned: list[PlannedRun], launch: bool = True) -> list[LaunchResult]:
    """Launch every unfinished run; refused (does-not-fit) runs are reported as failed, not launched.
    ``launch=False`` writes each unfinished run's directory and config only (status ``written``)."""
    results = []
    for run in planned:
        if run.error:
            results.append(LaunchResult(run.run.name, "failed", f"not launched: {run.error}"))
            continue
        if run_status(run.config.run.dir, run.config.checkpoint_dir, run.config.total_steps) == "finished":
            results.append(LaunchResult(run.run.name, "finished"))
            continue
        config_path = prepare_run_dir(run)
        if not launch:
            results.append(LaunchResult(run.run.name, "written", str(config_path)))
            continue
        launcher = _launch_slurm if study.cluster.launcher == "slurm" else _launch_here
        results.append(launcher(study, run, config_path))
        logger.info("%s: %s %s", run.run.name, results[-1].status, results[-1].detail)
    return results
