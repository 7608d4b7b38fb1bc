"""Non-finite weights or optimizer state are never saved as a checkpoint, under any non-finite policy.

The NaN is put straight into the state (what a corrupted optimizer file or a bad update leaves),
not into a batch: into the Adam moments right after step 4, before its save, so the weights are
still finite and only the optimizer state gives it away; or into a weight before step 5, whose
forward then goes non-finite and makes ``train.nonfinite_policy: stop`` save the "last good" weights.
Every checkpoint ``latest`` names afterwards is read back in full and must be finite.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lnstrain.checkpoint.layouts import read_full_state
from lnstrain.checkpoint.manager import read_latest
from lnstrain.checkpoint.metadata import is_complete
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.trainer import EXIT_NONFINITE

RUN = ["train.steps=6", "checkpoint.interval_steps=2", "train.eval_interval=0"]


def inject(trainer, where: str, at_step: int, on_rank: int | None = None) -> None:
    """NaN into the Adam moment ``exp_avg`` right after step ``at_step`` (``where="moment"``), or into
    a norm's gain right before step ``at_step + 1`` (``where="weight"``), on one rank or all."""
    import torch.distributed as dist

    take_step = trainer._step

    def step(batch, position, result):
        here = on_rank is None or dist.get_rank() == on_rank
        if here and where == "weight" and position.step == at_step:
            norm_gain = next(p for n, p in trainer.engine.module.named_parameters() if "norm" in n)
            with torch.no_grad():  # every token's forward reads it
                norm_gain.view(-1)[0] = math.nan
        outcome = take_step(batch, position, result)  # counts the step: position.step is now its number
        if here and where == "moment" and position.step == at_step:
            base = trainer.engine.base_optimizer
            base.state[base.param_groups[0]["params"][0]]["exp_avg"].view(-1)[0] = math.nan
        return outcome

    trainer._step = step


def nan_runs(rank: int, world_size: int, corpus: TinyCorpus, root: Path,
             runs: list[tuple[str, str, str, int, int | None]]) -> dict:
    from lnstrain.training.trainer import Trainer

    results = {}
    for name, policy, where, at_step, on_rank in runs:
        overrides = tiny_run_overrides(corpus, root / name) + RUN + [f"train.nonfinite_policy={policy}"]
        trainer = Trainer(load_config(TINY_RUN_CONFIG, overrides, world_size))
        inject(trainer, where, at_step, on_rank)
        results[name] = trainer.train()
    return results


def check_latest_is_finite(checkpoint_dir: Path, expected: str) -> None:
    latest = read_latest(checkpoint_dir)
    assert latest is not None and latest.name == expected, latest
    state = read_full_state(latest, with_optimizer=True)
    assert state.moments, latest
    for tensors in (state.weights, *state.moments.values()):
        for name, tensor in tensors.items():
            assert torch.isfinite(tensor).all(), (latest, name)


def checkpoints_of(root: Path, run: str) -> Path:
    return root / run / "tiny" / "checkpoints"


def test_nonfinite_state_is_never_saved(tiny_corpus, tmp_path):
    runs = [("skip_moment", "skip", "moment", 4, None), ("stop_weight", "stop", "weight", 4, None)]
    [results] = run_distributed(nan_runs, 1, tiny_corpus, tmp_path, runs, timeout_s=240)

    # a NaN moment with finite weights: the save at step 4 is refused, the run stops (exit 3)
    skip = results["skip_moment"]
    assert (skip.exit_code, skip.position.step) == (EXIT_NONFINITE, 4)
    assert skip.stop_reason == "non-finite weights or optimizer state at step 4 (not saved)"
    assert Path(skip.last_checkpoint).name == "global_step2"
    assert not (checkpoints_of(tmp_path, "skip_moment") / "global_step4").exists()
    check_latest_is_finite(checkpoints_of(tmp_path, "skip_moment"), "global_step2")

    # stop: step 5 goes non-finite; its "last good weights" hold the NaN weight, so they are not saved
    # and the last good checkpoint is step 4's
    stop = results["stop_weight"]
    assert stop.exit_code == EXIT_NONFINITE and "non-finite loss at step 5" in stop.stop_reason
    assert Path(stop.last_checkpoint).name == "global_step4" and not is_complete(
        checkpoints_of(tmp_path, "stop_weight") / "global_step5")
    check_latest_is_finite(checkpoints_of(tmp_path, "stop_weight"), "global_step4")


@pytest.mark.multirank
def test_every_rank_refuses_when_one_rank_holds_a_nan(tiny_corpus, tmp_path):
    runs = [("rank1", "skip", "moment", 4, 1)]  # only rank 1's ZeRO partition of the moments
    results = run_distributed(nan_runs, 2, tiny_corpus, tmp_path, runs, timeout_s=300)
    for result in results:
        run = result["rank1"]
        assert (run.exit_code, run.position.step, Path(run.last_checkpoint).name) == (EXIT_NONFINITE, 4, "global_step2")
    assert not (checkpoints_of(tmp_path, "rank1") / "global_step4").exists()
    check_latest_is_finite(checkpoints_of(tmp_path, "rank1"), "global_step2")
