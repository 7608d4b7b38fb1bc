"""``train.eval_tasks`` read a checkpoint only once its save is published: one written in the background
(``checkpoint.async_save``) waits until its files are complete, and a stop for a signal or the time
limit evaluates nothing and prints the command that evaluates it later. (The training run that reads
each checkpoint verified and signed, once published, is in tests/checkpoint/test_async_save.py.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from lnstrain.training.eval_tasks import CheckpointEvaluator


def test_checkpoints_due_are_evaluated_once_published_and_an_urgent_stop_names_the_command(tmp_path, caplog):
    train = SimpleNamespace(eval_tasks=["arc_easy", "piqa"], eval_tasks_interval=2,
                            eval_tasks_include_path=["my tasks"])
    evaluator = CheckpointEvaluator(SimpleNamespace(train=train), 0, torch.device("cpu"), metrics=None)
    evaluated: list[tuple[int, str, int]] = []
    evaluator.evaluate = lambda step_dir, step, tokens: evaluated.append((step, step_dir, tokens))
    checkpoints = tmp_path / "checkpoints"

    evaluator.saved(checkpoints / "global_step2", 2, 20, final=False)
    evaluator.saved(checkpoints / "global_step3", 3, 30, final=False)  # not a multiple of the interval
    evaluator.evaluate_published(in_flight=checkpoints / "global_step2")
    assert evaluated == []  # its files are still being written
    evaluator.saved(checkpoints / "global_step4", 4, 40, final=False)  # that save waited for step 2's
    evaluator.evaluate_published(in_flight=checkpoints / "global_step4")
    assert evaluated == [(2, str(checkpoints / "global_step2"), 20)]
    evaluator.evaluate_published(in_flight=None)
    assert [step for step, _, _ in evaluated] == [2, 4]  # each once

    evaluator.saved(checkpoints / "global_step6", 6, 60, final=False)
    evaluator.saved(checkpoints / "global_step7", 7, 70, final=True)  # the end: due whatever the interval
    with caplog.at_level(logging.WARNING):
        evaluator.evaluate_published(in_flight=None, skip=True)  # SIGTERM: the run stops at once
    assert [step for step, _, _ in evaluated] == [2, 4]
    for step in (6, 7):
        assert (f"the checkpoint of step {step} is not evaluated, the run is stopping; to evaluate it later: python "
                f"tools/evaluate.py --checkpoint {checkpoints / f'global_step{step}'} --tasks arc_easy,piqa "
                "--include-path 'my tasks'") in caplog.text
    evaluator.evaluate_published(in_flight=None)
    assert [step for step, _, _ in evaluated] == [2, 4]  # skipped ones are not evaluated after all
