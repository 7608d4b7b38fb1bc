"""Downstream results as lnstrain keeps them: one JSON file per evaluation, and the scalars it logs.

A file (``<run dir>/downstream/step<N>.json``, ``run_files.downstream_file``, or ``--output`` of
``tools/evaluate.py``)::

    {"model":   {"kind", "path", "dtype", "step", "tokens", "norm_scheme", ...},
     "tasks":   the task names asked for, "num_fewshot", "limit",
     "metrics": {task: {metric: value}},     lm-eval's "acc,none" is "acc", "acc_stderr,none" "acc_stderr";
                                             a filter other than "none" stays: "exact_match,strict-match"
     "lm_eval": lm-eval's own "results", "versions", "n-shot", "n-samples", "higher_is_better",
     "versions": {"lm_eval", "transformers", "torch", "lnstrain"}, "date"}

Each metric that is a number and not a standard error is logged as ``downstream/<task>/<metric>``
at the checkpoint's step. Nothing here imports lm-eval: the study reads these files without it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from lnstrain.no_follow import write_text_replacing
from lnstrain.run_files import downstream_file

SCALAR_PREFIX = "downstream"
HEADLINE_METRICS = ("acc_norm", "acc", "exact_match", "f1")
"""The one number shown per task where a table has room for one (the first the task has)."""


def metric_name(key: str) -> str:
    """lm-eval's ``<metric>,<filter>`` key as lnstrain names it: the filter only when it is not "none"."""
    metric, _, filter_name = key.partition(",")
    return metric if filter_name in ("", "none") else key


def task_metrics(lm_eval_results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """{task: {metric: value}} from lm-eval's ``results``; a value lm-eval could not compute ("N/A") is None."""
    metrics: dict[str, dict[str, float | None]] = {}
    for task, values in lm_eval_results.items():
        metrics[task] = {}
        for key, value in values.items():
            if key in ("alias", "name", "sample_len", "samples") or "," not in key:
                continue
            number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            metrics[task][metric_name(key)] = None if number is None or not math.isfinite(number) else float(number)
    return metrics


def logged_scalars(metrics: dict[str, dict[str, float | None]]) -> dict[str, float]:
    """``downstream/<task>/<metric>`` for every metric that is a number and not a standard error."""
    return {f"{SCALAR_PREFIX}/{task}/{metric}": value for task, values in metrics.items()
            for metric, value in values.items() if value is not None and "_stderr" not in metric}


def headline(values: dict[str, float | None]) -> tuple[str, float] | None:
    """The (metric, value) a table shows for a task: the first of ``HEADLINE_METRICS`` it has, else its
    first metric in name order."""
    numbers = {metric: value for metric, value in values.items() if value is not None and "_stderr" not in metric}
    for metric in HEADLINE_METRICS:
        if metric in numbers:
            return metric, numbers[metric]
    return next(iter(sorted(numbers.items())), None)


def write_results(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the results JSON (by rename, so a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_replacing(path, json.dumps(results, indent=2, default=str) + "\n")  # a link there is replaced
    return path


def read_results(path: str | os.PathLike) -> dict[str, Any] | None:
    """A results file, or None when it is missing or not a results JSON."""
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return results if isinstance(results, dict) and isinstance(results.get("metrics"), dict) else None


def run_headlines(run_dir: str | os.PathLike, step: int) -> dict[str, tuple[str, float]]:
    """{task: (metric, value)} of the run's evaluation of its checkpoint at ``step``; empty when there is none."""
    results = read_results(downstream_file(run_dir, step))
    if results is None:
        return {}
    found = {task: headline(values) for task, values in results["metrics"].items() if isinstance(values, dict)}
    return {task: pair for task, pair in found.items() if pair is not None}
