"""The learning-rate schedule: the pure function, and the LambdaLR that DeepSpeed steps and saves."""

from __future__ import annotations

import math

import pytest
import torch

from lnstrain.training.schedule import LrSchedule, build_scheduler, follow_schedule, lr_at, schedule_of, schedule_on_resume

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
        return optimizer, build_scheduler(optimizer, LrSchedule(decay="cosine", **SCHEDULE))

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


OLD = LrSchedule(lr=1e-2, warmup_steps=1, total_steps=100, min_lr_ratio=0.1)
KEYS = {"total_steps": "train.steps", "lr": "optim.lr", "min_lr_ratio": "optim.min_lr_ratio", "decay": "optim.decay",
        "warmup_steps": "optim.warmup_steps"}


def test_an_unchanged_schedule_goes_on_as_the_checkpoint_had_it():
    resumed = LrSchedule(**{**OLD.to_dict(), "total_steps": 400, "resumed_at": 100, "resumed_lr": 1e-3})
    for saved_in_effect in (OLD, resumed):  # a schedule an earlier resume chose is kept by the later ones
        configured = saved_in_effect.plain()
        assert schedule_on_resume(configured, configured, saved_in_effect, 150, "stretch", "ckpt", KEYS) == (
            saved_in_effect, None)


def test_a_longer_run_decays_from_the_current_lr_stretches_or_keeps_as_asked_with_one_line_saying_so():
    longer = LrSchedule(lr=1e-2, warmup_steps=1, total_steps=400, min_lr_ratio=0.1)
    now = OLD.lr_at(50)  # stopped half-way: the next update is step 51 (index 50)
    decayed, line = schedule_on_resume(longer, OLD, OLD, 50, "decay", "global_step50", KEYS)
    assert decayed.lr_at(50) == pytest.approx(now, rel=1e-12)  # no jump
    assert decayed.lr_at(399) == pytest.approx(1e-3, rel=1e-3) and decayed.lr_at(500) == pytest.approx(1e-3)
    assert all(decayed.lr_at(s) >= decayed.lr_at(s + 1) for s in range(50, 400))
    assert "\n" not in line and line.startswith("the learning-rate schedule changed since global_step50 "
                                                "(train.steps 100 -> 400): with optim.schedule_change decay, "
                                                f"the lr of step 51 is {now:.2e} (the checkpoint's schedule gave "
                                                f"{now:.2e}) and decays (cosine) from there to 1.00e-03 at step 400")
    assert f"stretch: {longer.lr_at(50):.2e}, keep: {now:.2e}" in line
    stretched, line = schedule_on_resume(longer, OLD, OLD, 50, "stretch", "global_step50", KEYS)
    assert stretched == longer and f"the lr of step 51 is {longer.lr_at(50):.2e}" in line
    kept, line = schedule_on_resume(longer, OLD, OLD, 50, "keep", "global_step50", KEYS)
    assert kept == OLD and kept.lr_at(200) == pytest.approx(1e-3) and "its last step 100" in line


def test_the_finished_demo_trained_longer_keeps_its_lr_instead_of_jumping_up():
    demo = LrSchedule(lr=3e-3, warmup_steps=10, total_steps=100, min_lr_ratio=0.1)  # ends at 3.0e-4
    longer = LrSchedule(lr=3e-3, warmup_steps=40, total_steps=400, min_lr_ratio=0.1)
    keys = KEYS | {"warmup_steps": "warmup steps (optim.warmup_fraction of the run)"}
    schedule, line = schedule_on_resume(longer, demo, demo, 100, "decay", "global_step100", keys)
    assert schedule.lr_at(100) == pytest.approx(3e-4) and schedule.lr_at(300) == pytest.approx(3e-4)
    assert "(train.steps 100 -> 400, warmup steps (optim.warmup_fraction of the run) 10 -> 40)" in line
    assert f"stretch: {longer.lr_at(100):.2e}" in line and longer.lr_at(100) > 2.5e-3  # the jump the issue saw


def test_a_schedule_reads_back_from_its_record_and_refuses_what_is_not_one():
    resumed = LrSchedule(**{**OLD.to_dict(), "resumed_at": 3, "resumed_lr": 5e-3})
    assert LrSchedule.from_dict(resumed.to_dict(), "x") == resumed
    for bad in ({"lr": 1e-3}, {**OLD.to_dict(), "warmup_steps": 1.5}, {**OLD.to_dict(), "resumed_at": 3}, [1]):
        with pytest.raises(ValueError, match="x: not a learning-rate schedule"):
            LrSchedule.from_dict(bad, "x")


def test_a_loaded_scheduler_follows_a_new_schedule_from_its_step():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=5.0)
    scheduler = build_scheduler(optimizer, OLD)
    for _ in range(30):
        optimizer.step()
        scheduler.step()
    new = LrSchedule(lr=2e-2, warmup_steps=1, total_steps=60, resumed_at=30, resumed_lr=OLD.lr_at(30))
    follow_schedule(scheduler, new)
    assert schedule_of(scheduler) == new and optimizer.param_groups[0]["lr"] == pytest.approx(new.lr_at(30))
    for step in range(31, 40):
        optimizer.step()
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(new.lr_at(step), rel=1e-12)
