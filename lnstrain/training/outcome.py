"""How a run ends: the exit status of ``launch/pretrain.py`` and the marker of a finished run.

The exit status tells a scheduler, a batch script or a job chain what happened:

====  ==================================================================================
0     finished: every step trained and the final evaluation written (or already finished
      before this launch: nothing is done then)
1     failed: an error (a traceback says which); rerunning the same command may not help
2     nothing started: a bad config, missing files, a busy rendezvous port
3     stopped by non-finite losses (``train.nonfinite_policy``); the last good weights are saved
75    stopped to be resumed: a signal (SIGTERM, SIGUSR1, a first Ctrl-C), ``--stop-at-step`` or
      ``train.exit_after_minutes`` made every rank save after the same step; the same command
      continues the run
130   interrupted: a second Ctrl-C stopped at once, or a Ctrl-C came before training began;
      the newest complete checkpoint is kept and the same command resumes from it
====  ==================================================================================

75 is ``EX_TEMPFAIL`` of BSD's ``sysexits.h``: "a temporary failure; the user is invited to retry".
A stopped run must never look like a finished one: a scheduler records exit 0 as success, and a job
that depends on it (SLURM's ``afterok``) would start on an unfinished run.

A run is finished when ``<run dir>/final_metrics.json`` (``run_files``) names its last step; the
trainer writes it last, after the final evaluation and checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from lnstrain.run_files import read_final_metrics

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command that Ctrl-C stopped


def finished_step(run_dir: str | Path, total_steps: int) -> int | None:
    """The step a finished run ended at (>= ``total_steps``), or None when the run is not finished
    (no marker, an unreadable one, or one from a shorter run that is being extended)."""
    metrics = read_final_metrics(run_dir)
    if metrics is None:
        return None
    try:
        step = int(metrics["step"])
    except (ValueError, KeyError, TypeError):
        return None
    return step if step >= total_steps else None
