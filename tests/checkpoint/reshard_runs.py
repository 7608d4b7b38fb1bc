"""What the resharding tests share: the tiny run they train and how a resumed loss curve is judged.

Each test trains the same 4-layer tiny run for 6 steps at one layout without interruption, saves
at step 3, resumes that checkpoint at other layouts and compares steps 4-6 with the uninterrupted
run's losses; only the precision and the layouts differ.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lnstrain.config.run_config import Config, load_config
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides

RESHARD_RUN = ["model.num_layers=4", "train.eval_interval=0", "train.steps=6"]
SAVED_STEP = 3
RESUMED_STEPS = [4, 5, 6]


def reshard_config(corpus: TinyCorpus, directory: str | os.PathLike, world_size: int,
                   overrides: Sequence[str] = ()) -> Config:
    """The resharding tests' run on ``corpus`` in ``directory``, with ``overrides`` applied last."""
    return load_config(TINY_RUN_CONFIG, tiny_run_overrides(corpus, directory) + RESHARD_RUN + list(overrides),
                       world_size)


def saved_step_dir(config: Config) -> Path:
    """Where ``config``'s run keeps its step-3 checkpoint."""
    return config.checkpoint_dir / f"global_step{SAVED_STEP}"


def layout_overrides(tensor: int, pipeline: int) -> list[str]:
    """``--set`` overrides for a (tensor, pipeline) layout; the data size is what the ranks leave."""
    return [f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}"]


def assert_continues(resumed: dict[int, float], straight: dict[int, float], tolerance: float, label: str) -> None:
    """``resumed`` trained exactly steps 4-6, each loss within ``tolerance`` of the uninterrupted run's."""
    assert sorted(resumed) == RESUMED_STEPS, (label, resumed)
    gaps = {step: abs(resumed[step] - straight[step]) for step in RESUMED_STEPS}
    assert max(gaps.values()) <= tolerance, (label, gaps, resumed, straight)
