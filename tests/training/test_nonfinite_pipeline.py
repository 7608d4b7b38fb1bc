"""train.nonfinite_policy across a pipeline (parallel.pipeline 2 on 2 ranks, fp32): every stage
takes the same decision, a skipped step leaves every stage's weights and Adam state as they were,
a stop ends both ranks at the same step, and a rollback restores both stages.

The NaN comes with the first micro-batch of global batch 5, as in ``test_nonfinite``, on one stage:
- the first stage's output (``test_nonfinite.poison_batch``): the last stage computes NaN logits
  from it, and DeepSpeed's ZeRO optimizer also finds the gradients non-finite;
- the last stage's logits only: the first stage's outputs stay finite, so without ZeRO only the
  guard's all-ranks decision keeps it from applying the NaN gradients it receives;
- the last stage's loss only (finite logits, which is all the guard watches): without ZeRO only
  ``NonFiniteGradientSkip``, reading the gradient norm every stage shares, keeps both stages from
  applying the NaN gradients.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lnstrain.config.run_config import load_config
from lnstrain.testing.distributed import run_distributed
from lnstrain.testing.tiny_corpus import TINY_RUN_CONFIG, TinyCorpus, tiny_run_overrides
from tests.training.test_nonfinite import POISONED_STEP, TOLERANCE, poison_batch

PIPELINE = ["parallel.pipeline=2", "train.eval_interval=0"]
GOOD_STEPS = (1, 2, 3, 4, 6)
POISONED_SAMPLE = (POISONED_STEP - 1) * 8  # global batch 8 in configs/tests/tiny.yaml


def _mark_when_read(trainer, first_sample: int) -> list[bool]:
    """Marks, in order, the micro-batches DeepSpeed reads on this rank: True for the one starting at
    ``first_sample``. The last stage sees no tokens in its forward or loss, but it reads each
    micro-batch (for the labels) before computing it, in the same order."""
    from lnstrain.data import iterate_micro_batches

    config = trainer.config.train
    target = next(iterate_micro_batches(trainer.train_data, first_sample, config.global_batch_size,
                                        config.micro_batch_size, 0, 1))["tokens"]
    marks: list[bool] = []
    pipeline_batches = trainer.engine._pipeline_batches

    class MarkedWhenRead(list):
        def __iter__(self):
            for inputs, labels in super().__iter__():
                marks.append(torch.equal(inputs.cpu(), target[:, : inputs.shape[1]]))
                yield inputs, labels

    trainer.engine._pipeline_batches = lambda micro_batches: MarkedWhenRead(pipeline_batches(micro_batches))
    return marks


def poison_last_stage_logits(trainer, first_sample: int) -> None:
    """NaN logits on the last stage for the micro-batch starting at ``first_sample``."""
    if trainer.groups.pp_rank == trainer.groups.pp_size - 1:
        marks = _mark_when_read(trainer, first_sample)
        trainer.engine.module.register_forward_hook(
            lambda _module, _args, output: output * math.nan if marks.pop(0) else output, prepend=True)


def poison_last_stage_loss(trainer, first_sample: int) -> None:
    """A NaN loss from finite logits for the micro-batch starting at ``first_sample`` (every output
    the guard watches stays finite; only the gradients tell)."""
    if trainer.groups.pp_rank == trainer.groups.pp_size - 1:
        marks = _mark_when_read(trainer, first_sample)
        module = trainer.engine.module
        loss_fn = module.loss_fn
        module.loss_fn = lambda logits, labels: loss_fn(logits, labels) * (math.nan if marks.pop(0) else 1.0)


POISONS = {"first_stage_output": poison_batch, "last_stage_logits": poison_last_stage_logits,
           "last_stage_loss": poison_last_stage_loss}


def _training_state(trainer) -> list[torch.Tensor]:
    """Copies of this rank's weights (the stage's and the optimizer's own) and its Adam state."""
    optimizer = trainer.engine.base_optimizer
    tensors = list(trainer.engine.module.parameters())
    tensors += [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return [t.detach().clone() for t in tensors]


def _watch_steps(trainer) -> tuple[list[bool], list[bool]]:
    """Per step on this rank: whether it changed the training state, and the guard's verdict."""
    changed: list[bool] = []
    verdicts: list[bool] = []
    engine, guard = trainer.engine, trainer.guard
    train_step, end_step = engine.train_step, guard.end_step

    def watched_train_step(*args, **kwargs):
        before = _training_state(trainer)
        result = train_step(*args, **kwargs)
        after = _training_state(trainer)
        changed.append(len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after)))
        return result

    def watched_end_step() -> bool:
        verdicts.append(end_step())
        return verdicts[-1]

    engine.train_step = watched_train_step
    guard.end_step = watched_end_step
    return changed, verdicts


def run_pipeline_policies(rank: int, world_size: int, corpus: TinyCorpus, root: Path, zero_stage: int,
                          poison: str, policies: tuple[str, ...]) -> dict:
    from lnstrain.training.trainer import Trainer

    torch.set_num_threads(1)

    def train(name: str, *extra: str, poisoned: bool = True) -> dict:
        overrides = tiny_run_overrides(corpus, root / name) + PIPELINE + [f"parallel.zero_stage={zero_stage}", *extra]
        trainer = Trainer(load_config(TINY_RUN_CONFIG, overrides, world_size))
        if poisoned:
            POISONS[poison](trainer, POISONED_SAMPLE)
        changed, verdicts = _watch_steps(trainer)
        result = trainer.train()
        return {"result": result, "changed": changed, "verdicts": verdicts, "stage": trainer.groups.pp_rank}

    runs = {"reference": train("reference", "train.skip_sample_ranges=[[32, 40]]", poisoned=False)}
    for policy in policies:
        runs[policy] = train(policy, f"train.nonfinite_policy={policy}")
    return runs


def _same_on_every_rank(ranks: list[dict], policy: str) -> dict:
    """The policy's run as rank 0 saw it, after checking that every rank saw it alike."""
    first, *others = (rank[policy] for rank in ranks)
    for other in others:
        assert other["verdicts"] == first["verdicts"], (policy, [r[policy]["verdicts"] for r in ranks])
        a, b = first["result"], other["result"]
        assert sorted(a.losses) == sorted(b.losses), policy
        assert all(a.losses[s] == b.losses[s] or math.isnan(a.losses[s]) and math.isnan(b.losses[s])
                   for s in a.losses), (policy, a.losses, b.losses)
        assert (a.exit_code, a.stop_reason, a.position, a.last_checkpoint, a.rollbacks) == \
               (b.exit_code, b.stop_reason, b.position, b.last_checkpoint, b.rollbacks), policy
    return first


CASES = [  # (poison, ZeRO stage, policies run)
    ("first_stage_output", 1, ("skip", "stop", "rollback")),  # both stages see NaN; ZeRO skips on its own too
    ("last_stage_logits", 0, ("skip", "stop", "rollback")),  # the first stage learns of it only from the guard
    ("last_stage_loss", 0, ("skip",)),  # no output is NaN: the shared gradient norm decides
]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("poison, zero_stage, policies", CASES, ids=[case[0] for case in CASES])
def test_nonfinite_policies_with_a_pipeline(tiny_corpus, tmp_path, poison, zero_stage, policies):
    ranks = run_distributed(run_pipeline_policies, 2, tiny_corpus, tmp_path, zero_stage, poison, policies,
                            timeout_s=240)  # a rank waiting in a collective the other never joins fails here
    assert [rank["reference"]["stage"] for rank in ranks] == [0, 1]
    reference = _same_on_every_rank(ranks, "reference")["result"]
    assert sorted(reference.losses) == list(GOOD_STEPS)
    guard_sees_it = poison != "last_stage_loss"

    # skip: one verdict on both stages; the NaN step changes neither stage's weights nor Adam state,
    # every other step changes both; the run goes on as if batch 5 had been skipped
    skip = _same_on_every_rank(ranks, "skip")
    assert skip["verdicts"] == [False, False, False, False, guard_sees_it, False]
    for rank in ranks:
        assert rank["skip"]["changed"] == [True, True, True, True, False, True], (rank["skip"]["stage"], rank["skip"])
    assert math.isnan(skip["result"].losses[POISONED_STEP]) and skip["result"].exit_code == 0
    assert (skip["result"].position.nonfinite_steps, skip["result"].position.skipped_batches) == (1, 1)
    for step in GOOD_STEPS:
        assert abs(skip["result"].losses[step] - reference.losses[step]) <= TOLERANCE, step
    if policies == ("skip",):
        return

    # stop: both ranks stop after step 5 (no rank left waiting), the last good weights saved
    stop = _same_on_every_rank(ranks, "stop")
    assert stop["verdicts"] == [False, False, False, False, True]
    assert stop["result"].exit_code == 3 and "non-finite loss at step 5" in stop["result"].stop_reason
    assert Path(stop["result"].last_checkpoint).name == "global_step5"
    assert sorted(stop["result"].losses) == [1, 2, 3, 4, 5]
    for rank in ranks:
        assert rank["stop"]["changed"][-1] is False, rank["stop"]["stage"]

    # rollback: both stages reload global_step3, replay step 4, skip batch 5: the reference's losses
    rollback = _same_on_every_rank(ranks, "rollback")
    assert rollback["verdicts"] == [False, False, False, False, True, False, False]
    assert [Path(p).name for p in rollback["result"].rollbacks] == ["global_step3"]
    assert rollback["result"].exit_code == 0 and sorted(rollback["result"].losses) == list(GOOD_STEPS)
    for step in GOOD_STEPS:
        assert abs(rollback["result"].losses[step] - reference.losses[step]) <= TOLERANCE, step
    assert abs(rollback["result"].eval_losses[6] - reference.eval_losses[6]) <= TOLERANCE
