"""fp16: the collector divides out the loss scale that multiplied the step's backward, also on the steps
where DeepSpeed's dynamic loss scaler changes it.

fp16 engines do not run on DeepSpeed's CPU accelerator, so `Fp16StepStub` plays the part of a DeepSpeed
fp16 step that decides which scale the gradients carry, with DeepSpeed's own `DynamicLossScaler`: every
micro-batch's backward multiplies the loss by the current scale, the gradients are read before the
optimizer step, and the optimizer step then updates the scale for the next step (x2 after `scale_window`
clean steps, /2 on overflow). In fp32, multiplying by a power of two is exact, so the unscaled norms must
equal those of an unscaled backward.
"""

from dataclasses import dataclass

import pytest
import torch
from deepspeed.runtime.fp16 import loss_scaler
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from lnstrain.analysis.depth_stats import DepthStatsCollector
from lnstrain.parallel.groups import ParallelGroups
from tests.analysis.conftest import tiny_model, token_windows

NUM_LAYERS = 3
MICRO_BATCHES = 2
SCALE_WINDOW = 2
OVERFLOW_STEPS = frozenset({4})  # steps 3 and 7 grow the scale (SCALE_WINDOW clean steps), step 4 halves it
STEPS = 7
GRADIENT_STATS = ("grad_norm", "output_grad_norm")


@pytest.fixture(autouse=True)
def no_process_group_needed(monkeypatch):
    # DynamicLossScaler asks deepspeed.comm for the rank to log an overflow.
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)


@dataclass(frozen=True)
class ScaledStep:
    scale_in_backward: float
    scale_after_step: float  # what TrainingEngine reports as StepResult.loss_scale
    stats: dict[str, float]

    @property
    def kind(self) -> str:
        ratio = self.scale_after_step / self.scale_in_backward
        return {2.0: "growth", 0.5: "overflow", 1.0: "normal"}[ratio]


class Fp16StepStub:
    """Forward and loss-scaled backward over the micro-batches, the before-step callback, then the
    scaler's update; overflow is forced (the gradients stay finite, so the norms can be compared)."""

    def __init__(self, model: torch.nn.Module, scaler: DynamicLossScaler) -> None:
        self.model = model
        self.scaler = scaler

    def train_step(self, windows: torch.Tensor, before_optimizer_step, overflow: bool) -> float:
        self.model.zero_grad(set_to_none=True)
        for chunk in windows.chunk(MICRO_BATCHES):
            loss = self.model.loss(chunk[:, :-1], chunk[:, 1:]) / MICRO_BATCHES
            (loss * self.scaler.cur_scale).backward()
        before_optimizer_step()
        self.scaler.update_scale(overflow)
        return self.scaler.cur_scale


def unscaled_stats(windows: torch.Tensor, loss_scale=None, passed_scale: float | None = None) -> dict[str, float]:
    """One step whose backward does not scale the loss (a scale of 1)."""
    model = tiny_model(NUM_LAYERS)
    collector = DepthStatsCollector(model, ParallelGroups.single_process(), interval=1, num_layers=NUM_LAYERS,
                                    loss_scale=loss_scale)
    collector.arm()
    Fp16StepStub(model, DynamicLossScaler(1.0, SCALE_WINDOW, 1.0, 1, False)).train_step(
        windows, collector.read_parameter_grads, overflow=False)
    return collector.collect(1, passed_scale)


def scaled_steps(windows: torch.Tensor, with_source: bool, pass_to_collect: str) -> list[ScaledStep]:
    """STEPS trainer-style steps; `pass_to_collect` names the scale given to `collect`: the one
    reported after the step (as the trainer has it), the one the backward used, or none."""
    model = tiny_model(NUM_LAYERS)
    scaler = DynamicLossScaler(init_scale=2.0**10, scale_window=SCALE_WINDOW, min_scale=1.0, delayed_shift=1,
                               consecutive_hysteresis=False)
    collector = DepthStatsCollector(model, ParallelGroups.single_process(), interval=1, num_layers=NUM_LAYERS,
                                    loss_scale=(lambda: scaler.cur_scale) if with_source else None)
    stub = Fp16StepStub(model, scaler)
    steps = []
    for step in range(1, STEPS + 1):
        collector.arm()
        scale_in_backward = scaler.cur_scale
        scale_after_step = stub.train_step(windows, collector.read_parameter_grads, overflow=step in OVERFLOW_STEPS)
        passed = {"after_step": scale_after_step, "in_backward": scale_in_backward, "none": None}[pass_to_collect]
        steps.append(ScaledStep(scale_in_backward, scale_after_step, collector.collect(step, passed)))
    return steps


def assert_true_gradient_norms(steps: list[ScaledStep], truth: dict[str, float]) -> None:
    for number, step in enumerate(steps, 1):
        assert sorted(step.stats) == sorted(truth)
        for tag, value in truth.items():
            assert step.stats[tag] == pytest.approx(value, rel=1e-6), f"step {number} ({step.kind}): {tag}"


@pytest.mark.parametrize("pass_to_collect", ["after_step", "none"])
def test_unscaled_norms_are_the_true_norms_on_normal_growth_and_overflow_steps(pass_to_collect):
    windows = token_windows(count=4, seq_len=8)
    truth = unscaled_stats(windows)
    steps = scaled_steps(windows, with_source=True, pass_to_collect=pass_to_collect)
    assert [step.kind for step in steps] == ["normal", "normal", "growth", "overflow", "normal", "normal", "growth"]
    assert {tag.split("/")[1] for tag in truth} >= set(GRADIENT_STATS)
    assert_true_gradient_norms(steps, truth)


def test_without_a_source_collect_divides_by_the_scale_it_is_given():
    windows = token_windows(count=4, seq_len=8)
    truth = unscaled_stats(windows)
    assert_true_gradient_norms(scaled_steps(windows, with_source=False, pass_to_collect="in_backward"), truth)
    error = {"normal": 1.0, "growth": 0.5, "overflow": 2.0}  # dividing by the scale reported after the step
    for step in scaled_steps(windows, with_source=False, pass_to_collect="after_step"):
        for stat in GRADIENT_STATS:
            tag = f"depth/{stat}/layer_01"
            assert step.stats[tag] == pytest.approx(truth[tag] * error[step.kind], rel=1e-6), (step.kind, tag)


def test_a_source_returning_none_means_an_unscaled_loss():
    windows = token_windows(count=4, seq_len=8)
    truth = unscaled_stats(windows)
    # The scale given to collect is ignored: the source has the say.
    assert unscaled_stats(windows, loss_scale=lambda: None, passed_scale=4.0) == pytest.approx(truth, rel=1e-9)
    assert unscaled_stats(windows, passed_scale=4.0) != pytest.approx(truth, rel=1e-3)
