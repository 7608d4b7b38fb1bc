"""The learning-rate schedule: the pure function, and the LambdaLR that DeepSpeed steps and saves."""

from __future__ import annotations

import math

import pytest
import torch

from lnstrain.training.schedule import build_scheduler, lr_at

SCHEDULE = dict(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)


def test_warmup_is_linear_from_zero():
    values = [lr_at(step, **SCHEDULE) for step in range(10)]
    assert values == pytest.approx([1e-3 * (step + 1) / 10 for step in range(10)])
    assert lr_at(9, **SCHEDULE) == pytest.approx(1e-3)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_decay_reaches_min_lr_at_total_steps_and_stays(decay):
    assert lr_at(10, decay=decay, **SCHEDULE) == pytest.approx(1e-3)
    assert lr_at(110, decay=decay, **SCHEDULE) == pytest.approx(1e-4)
    assert lr_at(500, decay=decay, **SCHEDULE) == pytest.approx(1e-4)
    values = [lr_at(step, decay=decay, **SCHEDULE) for step in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_cosine_and_linear_midpoints():
    assert lr_at(60, decay="cosine", **SCHEDULE) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_at(60, decay="linear", **SCHEDULE) == pytest.approx(1e-3 - 0.9e-3 * 0.5)


def test_constant_keeps_peak_lr_and_no_warmup_starts_at_peak():
    assert lr_at(100, decay="constant", **SCHEDULE) == 1e-3
    assert lr_at(0, lr=2e-3, warmup_steps=0, total_steps=10) == pytest.approx(2e-3)


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match="optim.decay"):
        lr_at(20, decay="exp", **SCHEDULE)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(-1, **SCHEDULE)


def test_scheduler_follows_lr_at_and_round_trips_its_state():
    def make():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=5.0)
        return optimizer, build_scheduler(optimizer, decay="cosine", **SCHEDULE)

    optimizer, scheduler = make()
    seen = []
    for _ in range(30):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([lr_at(step, decay="cosine", **SCHEDULE) for step in range(30)])

    state = scheduler.state_dict()
    resumed_optimizer, resumed = make()
    resumed.load_state_dict(state)
    resumed_optimizer.step()
    resumed.step()
    optimizer.step()
    scheduler.step()
    assert resumed.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    assert resumed.get_last_lr()[0] == pytest.approx(lr_at(31, decay="cosine", **SCHEDULE))
