"""A tiny run trained in two launches with every tracker on, shared by the evaluation and tracking tests.

Launch 1 trains steps 1-3 with dropout (so the random generators matter), TensorBoard, W&B in
offline mode, depth statistics every 2 steps, and ``train.eval_tasks`` (the repository's local task)
on the checkpoints of steps 2 and 3. Then checkpoint 3 is deleted, as if the machine had died before
saving it: launch 2 (``train.steps=4``, no downstream tasks: importing lm-eval in a rank costs
seconds) resumes from step 2, trains step 3 again and then step 4. Datasets' cache is a temporary
directory and the Hugging Face libraries are offline: nothing here reaches a network.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, tiny_run_overrides
from tests.training.conftest import tiny_corpus  # noqa: F401  (a fixture, used by name)

REPO = Path(__file__).resolve().parents[2]
TASK = "lnstrain_tiny_grammar"
TASKS_DIR = "configs/eval_tasks"
HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None and importlib.util.find_spec("accelerate") is not None
HAVE_WANDB = importlib.util.find_spec("wandb") is not None
NO_LM_EVAL = "lm-evaluation-harness is not installed (pip install 'lnstrain[eval]')"
NO_WANDB = "wandb is not installed (pip install 'lnstrain[wandb]')"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}


@dataclass
class TrackedRun:
    run_dir: Path
    first_losses: dict[int, float]
    second_losses: dict[int, float]


def train(rank: int, world_size: int, overrides: list[str]) -> tuple[str, dict[int, float]]:
    from lnstrain.training.trainer import pretrain

    config = load_config(TINY_RUN_CONFIG, overrides, world_size)
    result = pretrain(config)
    return str(config.run.dir), result.losses


def tracked_overrides(corpus, output_dir: Path, steps: int, eval_tasks: bool) -> list[str]:
    overrides = tiny_run_overrides(corpus, output_dir) + [
        f"train.steps={steps}", "checkpoint.interval_steps=2", "model.hidden_dropout=0.1", "train.eval_interval=0",
        "logging.tensorboard=true", "logging.depth_stats_interval=2"]
    if HAVE_WANDB:
        overrides.append("logging.wandb.mode=offline")
    if HAVE_LM_EVAL and eval_tasks:
        overrides += [f"train.eval_tasks=[{TASK}]", f"train.eval_tasks_include_path=[{TASKS_DIR}]",
                      "train.eval_tasks_interval=2"]
    return overrides


@pytest.fixture(scope="session")
def offline_in_repo(tmp_path_factory):
    """Offline Hugging Face libraries and W&B, their caches and files in temporary directories (W&B's in
    the run directory), run from the repository root (where TASKS_DIR, a relative include path, is)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE.items():
            patch.setenv(name, value)
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets_cache")))
        patch.delenv("WANDB_DIR", raising=False)
        patch.chdir(REPO)
        yield


@pytest.fixture(scope="session")
def tracked_run(tiny_corpus, tmp_path_factory, offline_in_repo) -> TrackedRun:  # noqa: F811
    output_dir = tmp_path_factory.mktemp("tracked")
    run_dir, first = run_distributed(train, 1, tracked_overrides(tiny_corpus, output_dir, steps=3, eval_tasks=True))[0]
    checkpoints = Path(run_dir) / "checkpoints"
    shutil.rmtree(checkpoints / "global_step3")
    (checkpoints / "latest").write_text("global_step2")
    _, second = run_distributed(train, 1, tracked_overrides(tiny_corpus, output_dir, steps=4, eval_tasks=False))[0]
    return TrackedRun(Path(run_dir), first, second)


@pytest.fixture
def one_thread():
    """torch on one thread while a test scores the tiny model: its many small operations gain nothing
    from a second thread, and on a busy machine two threads waiting for each other cost 20 times more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
