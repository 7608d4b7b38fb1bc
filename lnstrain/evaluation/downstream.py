"""lm-evaluation-harness tasks on a model, by lm-eval's own task names, with local task YAMLs.

    model = load_checkpoint_model("runs/lns/checkpoints")          # or load_hf_directory_model(...)
    results = evaluate_downstream(model, DownstreamTasks(["hellaswag", "arc_easy"]))
    write_results(results, downstream_file(model.run_dir, model.step))

Tasks are found by lm-eval's ``TaskManager``: its built-in tasks and the YAMLs under each include
path. A local task needs no network: ``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``
(configs/eval_tasks/ has one). When every task asked for is in the include paths, lm-eval's several
hundred built-in task directories are not indexed (about 10 s saved per evaluation on a small CPU).
lm-eval scores the model through its ``HFLM`` wrapper, given the model object (no second load).
lm-eval seeds Python's, NumPy's and torch's generators; a caller that must not be disturbed (the
trainer) keeps its own states around the call.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lnstrain.evaluation.hf_model import EvaluatedModel
from lnstrain.evaluation.results import logged_scalars, task_metrics
from lnstrain.tracking.run_sinks import open_run_sinks

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'lm_eval[hf]' (or pip install 'lnstrain[eval]')"
KEPT_FROM_LM_EVAL = ("results", "groups", "group_subtasks", "versions", "n-shot", "n-samples", "higher_is_better")


@dataclass
class DownstreamTasks:
    """What to evaluate and how.

    Attributes:
        names: lm-eval task, group or tag names (``hellaswag``, ``arc_easy``, ``mmlu``), or paths of task YAMLs.
        include_paths: directories of task YAMLs of your own (lm-eval's ``--include_path``).
        num_fewshot: examples in each prompt; None: each task's own default (0 for most).
        limit: at most this many documents per task (a fraction below 1: that share); None: all.
        batch_size: requests per forward pass (an int, or lm-eval's ``auto`` on a GPU).
    """

    names: list[str]
    include_paths: list[str] = field(default_factory=list)
    num_fewshot: int | None = None
    limit: float | None = None
    batch_size: int | str = 8


def import_lm_eval() -> Any:
    """The lm_eval module (with its Hugging Face model wrapper's dependencies), or ImportError with the install line."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (needs accelerate: lm_eval[hf])
    except ImportError as e:
        raise ImportError(f"downstream evaluation needs lm-evaluation-harness: {INSTALL_HINT} ({e})") from e
    return lm_eval


def task_manager(tasks: DownstreamTasks) -> Any:
    """lm-eval's TaskManager for ``tasks``: the include paths alone when they hold every name asked for."""
    from lm_eval.tasks import TaskManager

    include = [str(path) for path in tasks.include_paths]
    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        if not unknown_names(local, tasks.names):
            return local
    return TaskManager(include_path=include or None)


def unknown_names(manager: Any, names: list[str]) -> list[str]:
    """The names that are neither a task, group or tag ``manager`` knows nor the path of a YAML file."""
    known = set(manager.all_tasks)
    return [name for name in names if name not in known and not Path(name).is_file()]


def task_problems(tasks: DownstreamTasks, key: str = "--tasks") -> list[str]:
    """Everything that would stop ``evaluate_downstream`` before it loads a model: lm-eval missing, an
    include path missing, a task name lm-eval does not know (with the closest names)."""
    if not tasks.names:
        return [f"{key}: name at least one lm-eval task"]
    try:
        import_lm_eval()
    except ImportError as e:
        return [f"{key}: {e}"]
    problems = [f"{key}: include path {path} is not a directory" for path in tasks.include_paths
                if not Path(path).is_dir()]
    if problems:
        return problems
    manager = task_manager(tasks)
    import difflib

    for name in unknown_names(manager, tasks.names):
        close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        problems.append(f"{key}: lm-eval knows no task, group or tag {name!r}{hint}; a task of your own needs its "
                        "YAML under an include path")
    return problems


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def evaluate_downstream(model: EvaluatedModel, tasks: DownstreamTasks, log_samples: bool = False) -> dict[str, Any]:
    """Run the tasks on ``model``; the results as ``lnstrain.evaluation.results`` describes them.

    ``log_samples``: also return lm-eval's per-document records under ``samples`` (not JSON-ready).
    """
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    started = time.monotonic()
    lm = HFLM(pretrained=model.model, tokenizer=model.tokenizer, batch_size=tasks.batch_size)
    raw = lm_eval.simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=task_manager(tasks),
                                  num_fewshot=tasks.num_fewshot, limit=tasks.limit, log_samples=log_samples)
    metrics = task_metrics(raw["results"])
    logger.info("downstream evaluation of %s in %.0f s: %s", model.source.get("path"), time.monotonic() - started,
                ", ".join(f"{tag.removeprefix('downstream/')} {value:.4f}"
                          for tag, value in logged_scalars(metrics).items()))
    results: dict[str, Any] = {
        "model": model.source, "tasks": list(tasks.names), "num_fewshot": tasks.num_fewshot, "limit": tasks.limit,
        "metrics": metrics, "lm_eval": {key: raw[key] for key in KEPT_FROM_LM_EVAL if key in raw},
        "versions": {package: _version(package) for package in ("lm_eval", "transformers", "torch", "lnstrain")},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if log_samples:
        results["samples"] = raw.get("samples", {})
    return results


def log_to_run(results: dict[str, Any], model: EvaluatedModel, wandb: bool = True) -> list[str]:
    """Log the downstream scalars to the checkpoint's run at the checkpoint's step: its TensorBoard and
    (``wandb``) its W&B run, as its config has them; a W&B run that cannot start (wandb missing here,
    no network) is an error in the log, the results file is already written. Returns where they went."""
    config = model.run_config
    if model.run_dir is None or config is None or model.step is None:
        return []
    logging_config = config.logging
    wandb_config = logging_config.wandb if wandb else dataclasses.replace(logging_config.wandb, mode="disabled")
    sinks = open_run_sinks(model.run_dir, tensorboard=logging_config.tensorboard, wandb=wandb_config,
                           run_name=config.run.name, continue_run=True, skip_logged_steps=False,
                           wandb_failure_stops=False)
    try:
        sinks.log_scalars(logged_scalars(results["metrics"]), model.step, model.tokens)
    finally:
        names = [sink.name for sink in sinks.sinks]
        sinks.close()
    return names
