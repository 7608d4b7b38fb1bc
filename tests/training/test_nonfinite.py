"""train.nonfinite_policy: a NaN in one global batch is skipped, stops the run, or rolls it back.

The NaN is injected by the test only: a forward hook (registered before the trainer's guard sees the
output) turns the model's output into NaN whenever the micro-batch is the first one of global batch
5 (samples 32..39), so the fault follows the data, as a real bad batch would.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lnstrain.checkpoint.metadata import read_metadata
from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from lnstrain.training.health import LossSpikeDetector
from tests.training.test_resume import tensorboard_tags

POISONED_STEP = 5  # samples [32, 40) with global batch 8
TOLERANCE = 1e-6


def poison_batch(trainer, first_sample: int, gradient_only: bool = False) -> None:
    """NaN in the model's output on the micro-batch starting at ``first_sample``, or with
    ``gradient_only`` in that output's gradient alone (the forward and the loss stay finite)."""
    from lnstrain.data import iterate_micro_batches

    config = trainer.config.train
    target = next(iterate_micro_batches(trainer.train_data, first_sample, config.global_batch_size,
                                        config.micro_batch_size, 0, 1))["tokens"]

    def to_nan(_module, args, output):
        inputs = args[0]
        if not torch.equal(inputs.cpu(), target[:, : inputs.shape[1]]):
            return output
        if gradient_only:
            output.register_hook(lambda grad: grad * math.nan)
            return output
        return output * math.nan

    trainer.engine.module.register_forward_hook(to_nan, prepend=True)


def run_policies(rank: int, world_size: int, corpus: TinyCorpus, root: Path) -> dict:
    from lnstrain.training.trainer import Trainer

    def train(name: str, *extra: str, poisoned: bool = True):
        overrides = tiny_run_overrides(corpus, root / name) + ["train.eval_interval=0", *extra]
        trainer = Trainer(load_config(TINY_RUN_CONFIG, overrides, world_size))
        if poisoned:
            poison_batch(trainer, (POISONED_STEP - 1) * 8)
        return trainer.train()

    return {"straight": train("straight", poisoned=False),
            "reference": train("reference", "train.skip_sample_ranges=[[32, 40]]", poisoned=False),
            "skip": train("skip", "train.nonfinite_policy=skip", "logging.tensorboard=true"),
            "stop": train("stop", "train.nonfinite_policy=stop"),
            "rollback": train("rollback", "train.nonfinite_policy=rollback")}


def test_nonfinite_policies(tiny_corpus, tmp_path):
    [runs] = run_distributed(run_policies, 1, tiny_corpus, tmp_path, timeout_s=240)
    straight, reference, skip, stop, rollback = (runs[k] for k in ("straight", "reference", "skip", "stop", "rollback"))
    assert sorted(reference.losses) == [1, 2, 3, 4, 6] and reference.position.skipped_batches == 1
    for step in (1, 2, 3, 4):
        assert reference.losses[step] == straight.losses[step]
    assert abs(reference.losses[6] - straight.losses[6]) > 1e-4  # batch 5 matters

    # skip: the NaN step changes nothing, training goes on as if batch 5 had been skipped
    assert math.isnan(skip.losses[POISONED_STEP]) and skip.exit_code == 0 and skip.stop_reason == "finished"
    assert (skip.position.nonfinite_steps, skip.position.skipped_batches) == (1, 1)
    for step in (1, 2, 3, 4, 6):
        assert abs(skip.losses[step] - reference.losses[step]) <= TOLERANCE, step
    assert read_metadata(Path(skip.last_checkpoint)).nonfinite_steps == 1
    tags = tensorboard_tags(tmp_path / "skip" / "tiny" / "tensorboard")
    assert {"train/nonfinite_steps", "train/skipped_batches", "train/loss_spikes"} <= tags, sorted(tags)

    # stop: the last good weights are saved, exit status 3
    assert stop.exit_code == 3 and "non-finite loss at step 5" in stop.stop_reason, stop.stop_reason
    assert Path(stop.last_checkpoint).name == "global_step5" and 6 not in stop.losses
    assert read_metadata(Path(stop.last_checkpoint)).nonfinite_steps == 1

    # rollback: back to global_step3, batch 5 never trained on, the same losses as the reference
    assert [Path(p).name for p in rollback.rollbacks] == ["global_step3"] and rollback.exit_code == 0
    for step in (1, 2, 3, 4, 6):
        assert abs(rollback.losses[step] - reference.losses[step]) <= TOLERANCE, step
    assert POISONED_STEP not in rollback.losses  # replaced by the skipped step after the rollback
    assert abs(rollback.eval_losses[6] - reference.eval_losses[6]) <= TOLERANCE
    final = read_metadata(Path(rollback.last_checkpoint))
    assert final.skipped_sample_ranges == [[32, 40]] and final.skipped_batches == 1 and final.nonfinite_steps == 1


def test_loss_spike_detector():
    detector = LossSpikeDetector(window=4, zscore=3.0)
    assert [detector.observe(x) for x in (2.0, 2.1, 1.9, 2.0)] == [None] * 4  # window filling
    assert detector.observe(2.05) is None
    assert detector.observe(9.0) > 3.0
    assert detector.observe(math.nan) is None and len(detector.recent) == 4
    assert LossSpikeDetector(window=0, zscore=3.0).observe(100.0) is None
