"""lm-evaluation-harness tasks on a model, by lm-eval's own task names, with local task YAMLs.

    model = load_checkpoint_model("runs/lns/checkpoints")          # or load_hf_directory_model(...)
    results = evaluate_downstream(model, DownstreamTasks(["hellaswag", "arc_easy"]))
    write_results(results, downstream_file(model.run_dir, model.step))

Tasks are found by lm-eval's ``TaskManager``: its built-in tasks and the YAMLs under each include
path. A local task needs no network: ``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``
(configs/eval_tasks/ has one); a relative ``data_files`` path in a YAML under an include path is read
from the YAML's own directory (lm-eval would read it from the current one), so the task works from
any directory. When every task asked for is in the include paths, lm-eval's several hundred built-in
task directories are not indexed (about 10 s saved per evaluation on a small CPU).

Every task's data is loaded once before any model is (``task_data_problems``), so a data set that
cannot be had ends the command at once with one line. Where the Hugging Face Hub cannot be reached
(``stay_offline_unless_the_hub_answers``), the Hugging Face libraries are told so before they start,
and read their caches only, instead of retrying for most of a minute.
lm-eval scores the model through its ``HFLM`` wrapper, given the model object (no second load).
lm-eval seeds Python's, NumPy's and torch's generators; a caller that must not be disturbed (the
trainer) keeps its own states around the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
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


HUB_ANSWER_TIMEOUT_S = 3.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def stay_offline_unless_the_hub_answers(timeout_s: float = HUB_ANSWER_TIMEOUT_S) -> str | None:
    """Where the Hugging Face Hub (``HF_ENDPOINT``, default huggingface.co) does not answer within
    ``timeout_s``, set ``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` for this process, so that its
    caches are read and nothing is retried. Returns why the Hub is not asked (also when one of these
    variables was set already), or None when it answered. Call it before anything imports
    huggingface_hub, datasets or lm-eval (they read these variables when imported)."""
    already = [name for name in OFFLINE_VARIABLES if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")]
    if already:
        return f"{already[0]} is set"
    endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(error.strerror or str(error))

    probe = threading.Thread(target=connect, daemon=True)  # name resolution has no timeout of its own
    probe.start()
    probe.join(timeout_s)
    why = outcome[0] if outcome else f"no answer in {timeout_s:g} s"
    if why is None:
        return None
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    return f"{host} cannot be reached from here ({why})"


_MANAGERS: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}


def task_manager(tasks: DownstreamTasks) -> Any:
    """lm-eval's TaskManager for ``tasks``: the include paths alone when they hold every name asked for.
    Made once per process for the same names and paths (indexing lm-eval's own tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    include = [str(path) for path in tasks.include_paths]
    key = (tuple(include), tuple(tasks.names))
    if key not in _MANAGERS:
        local = TaskManager(include_path=include, include_defaults=False) if include else None
        if local is None or unknown_names(local, tasks.names):
            local = TaskManager(include_path=include or None)
        _MANAGERS[key] = local
    return _MANAGERS[key]


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


def _yaml_path(manager: Any, name: str) -> Path | None:
    """Where ``manager`` found the task YAML named ``name`` (lm-eval 0.4.x keeps it in one of two forms)."""
    entry = manager.task_index.get(name)
    path = entry.get("yaml_path") if isinstance(entry, dict) else getattr(entry, "yaml_path", None)
    return Path(path) if path not in (None, -1) else None


def _load_task_yaml(path: Path) -> dict[str, Any]:
    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # lm_eval 0.4.10 and later
    except ImportError:
        from lm_eval.utils import load_yaml_config

        return load_yaml_config(str(path))
    return load_yaml(path, resolve_func=True)


def _from_directory(data_files: Any, directory: Path) -> Any:
    """``data_files`` (a path, a list or a split -> path mapping) with each relative path that names a
    file in ``directory`` made absolute."""
    if isinstance(data_files, dict):
        return {split: _from_directory(files, directory) for split, files in data_files.items()}
    if isinstance(data_files, list):
        return [_from_directory(files, directory) for files in data_files]
    if isinstance(data_files, str) and "://" not in data_files and not Path(data_files).is_absolute() \
            and (directory / data_files).exists():
        return str(directory / data_files)
    return data_files


def task_specs(tasks: DownstreamTasks, manager: Any) -> list[str | dict[str, Any]]:
    """What to hand lm-eval for ``tasks.names``: the name, or for a task of an include path whose
    ``data_files`` are relative to its YAML, the YAML's config with those paths made absolute."""
    include = [Path(path).resolve() for path in tasks.include_paths]
    specs: list[str | dict[str, Any]] = []
    for name in tasks.names:
        path = _yaml_path(manager, name)
        if path is None or not any(path.resolve().is_relative_to(directory) for directory in include):
            specs.append(name)
            continue
        config = _load_task_yaml(path)
        kwargs = config.get("dataset_kwargs") or {}
        if "task" not in config or "data_files" not in kwargs:
            specs.append(name)
            continue
        data_files = _from_directory(kwargs["data_files"], path.resolve().parent)
        specs.append({**config, "dataset_kwargs": {**kwargs, "data_files": data_files}})
    return specs


def task_data_problems(tasks: DownstreamTasks, offline: str | None = None, key: str = "--tasks") -> list[str]:
    """Load every task's data as the evaluation will (the Hub's through the datasets cache): one line
    per task that cannot be had, and why (``offline``: why the Hub is not asked). Before any model loads."""
    import lm_eval.tasks

    manager = task_manager(tasks)
    problems = []
    for name, spec in zip(tasks.names, task_specs(tasks, manager)):
        try:
            lm_eval.tasks.get_task_dict([spec], manager)
        except Exception as error:  # noqa: BLE001  (whatever datasets raises: one line, the traceback at debug)
            logger.debug("loading the data of task %s", name, exc_info=True)
            why = " ".join(f"{type(error).__name__}: {error}".split())
            hint = (f"; {offline}, so only the datasets cache ({os.environ.get('HF_DATASETS_CACHE') or '~/.cache/huggingface/datasets'}) "
                    "is read: run the same command once where the Hub answers (it caches the data), or use a "
                    "task of your own (--include-path)") if offline else ""
            problems.append(f"{key}: the data of {name} cannot be loaded ({why[:300]}){hint}")
    return problems


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def _stderr_set_aside() -> Iterator[None]:
    """What is written to file descriptor 2 meanwhile (lm-eval's progress bars, the ``git describe`` it
    runs for its records, its notes) goes to a temporary file, shown only if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as aside:
        os.dup2(aside.fileno(), 2)
        try:
            yield
        except BaseException:
            sys.stderr.flush()
            os.dup2(saved, 2)
            aside.seek(0)
            sys.stderr.write(aside.read().decode(errors="replace")[-20000:])
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def evaluate_downstream(model: EvaluatedModel, tasks: DownstreamTasks, log_samples: bool = False,
                        quiet: bool = False) -> dict[str, Any]:
    """Run the tasks on ``model``; the results as ``lnstrain.evaluation.results`` describes them.

    ``log_samples``: also return lm-eval's per-document records under ``samples`` (not JSON-ready).
    ``quiet``: what lm-eval writes to stderr is shown only when it fails (``_stderr_set_aside``).
    """
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    started = time.monotonic()
    manager = task_manager(tasks)
    with _stderr_set_aside() if quiet else contextlib.nullcontext():
        lm = HFLM(pretrained=model.model, tokenizer=model.tokenizer, batch_size=tasks.batch_size)
        raw = lm_eval.simple_evaluate(model=lm, tasks=task_specs(tasks, manager), task_manager=manager,
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
