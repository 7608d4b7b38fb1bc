"""A NaN that appears only in backward (finite loss, NaN gradients) is a non-finite step too.

The test turns the gradient of the model's output into NaN on global batch 5 (the forward and the
loss stay finite). DeepSpeed's engine then skips the update (lnstrain's gradient check in fp32
without ZeRO, DeepSpeed's own overflow check elsewhere); the trainer must count the step as
non-finite, apply ``train.nonfinite_policy``, keep the learning-rate schedule on its step, and
record no depth statistics for it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.training.test_nonfinite import POISONED_STEP, TOLERANCE, poison_batch


def run(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import Trainer

    def train(name: str, *extra: str, poisoned: bool = True):
        overrides = tiny_run_overrides(corpus, root / name) + ["train.eval_interval=0", *extra]
        trainer = Trainer(load_config(TINY_RUN_CONFIG, overrides, world_size))
        if poisoned:
            poison_batch(trainer, (POISONED_STEP - 1) * 8, gradient_only=True)
        depth_stats = {}
        record = trainer.metrics.record_depth_stats

        def keep(stats, step):
            depth_stats[step] = all(math.isfinite(value) for value in stats.values())
            record(stats, step)

        trainer.metrics.record_depth_stats = keep
        result = trainer.train()
        return {"losses": result.losses, "exit_code": result.exit_code, "nonfinite": result.position.nonfinite_steps,
                "lr": trainer.engine.scheduler.get_last_lr()[0], "stop_reason": result.stop_reason,
                "depth_stats": depth_stats}

    return {"reference": train("reference", "train.skip_sample_ranges=[[32, 40]]", poisoned=False),
            "skip": train("skip", "train.nonfinite_policy=skip", "logging.depth_stats_interval=1"),
            "stop": train("stop", "train.nonfinite_policy=stop")}


@pytest.mark.multirank
@pytest.mark.slow
def test_nan_gradients_with_a_finite_loss_are_a_nonfinite_step(tiny_corpus, tmp_path):
    [runs] = run_distributed(run, 1, tiny_corpus, tmp_path, timeout_s=240)
    reference, skip, stop = runs["reference"], runs["skip"], runs["stop"]
    assert math.isfinite(skip["losses"][POISONED_STEP])  # only backward saw the NaN
    assert skip["nonfinite"] == 1 and skip["exit_code"] == 0
    for step in (1, 2, 3, 4, 6):  # the bad update was not applied and the schedule kept its step
        assert abs(skip["losses"][step] - reference["losses"][step]) <= TOLERANCE, step
    assert skip["lr"] == reference["lr"]
    # depth statistics every step, except the skipped one (its gradients were NaN)
    assert skip["depth_stats"] == {step: True for step in (1, 2, 3, 4, 6)}
    assert stop["exit_code"] == 3 and f"at step {POISONED_STEP}" in stop["stop_reason"]
