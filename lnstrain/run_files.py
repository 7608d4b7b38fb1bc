"""The run directory: every name lnstrain writes or reads in it, in one place.

``<run.output_dir>/<run.name>/`` (``Config.run.dir``; docs/architecture.md, "Run directory")::

    config.yaml             the resolved config, written by rank 0 at every start of the trainer
    checkpoints/            the default ``checkpoint.dir``: ``global_step<N>/`` and ``latest``
                            (docs/architecture.md, "Checkpoint format")
    tensorboard/            TensorBoard event files (``logging.tensorboard``); the final evaluation is
                            the scalar ``eval/loss`` at the last step
    final_metrics.json      {"step", "tokens", "eval_loss", "eval_ppl"}, written last by rank 0 when
                            the run finishes: naming the last step, it marks the run finished
    downstream/step<N>.json lm-evaluation-harness results of checkpoint N (``train.eval_tasks`` or
                            ``tools/evaluate.py``; lnstrain/evaluation/results.py)
    wandb_run.json          the run's W&B run id, its last logged step and next row, when
                            ``logging.wandb`` is on (lnstrain/tracking/wandb_sink.py)
    wandb/                  W&B's own files (offline runs to ``wandb sync``), unless WANDB_DIR is set
    lnstrain.log            rank 0's console lines of every launch, appended, and the stop, resume
                            and failure lines even when the console went away (training/run_log.py)
    .lnstrain.lock          rank 0's flock while a trainer runs: a second trainer stops (exit 2);
                            also in ``checkpoint.dir`` when that lies elsewhere (training/run_lock.py)

and, when a study or ``launch/slurm/make_sbatch.py`` launches the run::

    study_config.yaml       the config the study launches the run with
    launch.log              the output of a run a study launched on this machine
    job.sbatch              the SLURM batch script
    slurm_job_id            the id of the last job submitted for the run (of a chain, the last link)
    slurm_jobs.log          one line per job end: '<job id> restart=<n> exit=<status>'
    slurm-<job id>.out      each job's output
    hostfile.<job id>       each job's DeepSpeed hostfile

Nothing here imports torch: the study and the launch scripts read these names before any training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

from lnstrain.no_follow import read_regular_file

RUN_CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
"""In the checkpoint directory: the name of the newest complete ``global_step<N>``."""
TENSORBOARD_DIR = "tensorboard"
EVAL_LOSS_TAG = "eval/loss"
FINAL_METRICS_FILE = "final_metrics.json"
DOWNSTREAM_DIR = "downstream"
WANDB_RUN_FILE = "wandb_run.json"
WANDB_DIR = "wandb"
RUN_LOCK_FILE = ".lnstrain.lock"
RUN_LOG_FILE = "lnstrain.log"

STUDY_CONFIG_FILE = "study_config.yaml"
LAUNCH_LOG = "launch.log"
JOB_SCRIPT = "job.sbatch"
SLURM_JOB_ID_FILE = "slurm_job_id"
SLURM_JOBS_LOG = "slurm_jobs.log"
SLURM_OUTPUT = "slurm-%j.out"
"""sbatch's ``--output`` pattern: SLURM puts the job id for ``%j``."""
HOSTFILE_PREFIX = "hostfile."


def downstream_file(run_dir: str | Path, step: int) -> Path:
    """Where the downstream evaluation of the run's checkpoint at ``step`` is written."""
    return Path(run_dir) / DOWNSTREAM_DIR / f"step{step}.json"


class FinalMetrics(TypedDict):
    """``final_metrics.json``: the final evaluation, at the run's last step."""

    step: int
    tokens: int
    eval_loss: float | None
    """None when the run had no validation data."""
    eval_ppl: float | None


def read_final_metrics(run_dir: str | Path) -> dict | None:
    """``final_metrics.json`` of ``run_dir`` as written, or None when it is missing or not a JSON object.
    Its values are not checked: the caller takes what it needs."""
    try:  # not through a link, nor a file with other names (no_follow)
        metrics = json.loads(read_regular_file(Path(run_dir) / FINAL_METRICS_FILE, 1 << 16))
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) else None
