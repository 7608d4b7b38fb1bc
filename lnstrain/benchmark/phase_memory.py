"""Peak tensor memory of each phase of a real training step: forward, backward, optimizer step.

``PhaseMemory`` is ``LiveTensorBytes`` that also knows which phase of the step is running and keeps
the peak of each: the forward starts when the model's forward is called, the backward at the first
operator the autograd engine runs, the step when the engine's ``before_optimizer_step`` callback
fires (gradients complete). A pipeline interleaves forwards and backwards of micro-batches; each
operator still counts towards the phase it belongs to.

``measure_step_memory`` builds the DeepSpeed engine for a config on this rank under the tracker and
takes a few steps. The first step differs from the others (Adam's moments and DeepSpeed's fp32
copies appear in it), so the phases are read from the last step, when the run is steady: that is
what a long training run holds. Collective: every rank of the world calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lnstrain.benchmark.tensor_memory import LiveTensorBytes
from lnstrain.config.run_config import Config

PHASES = ("forward", "backward", "step")


class PhaseMemory(LiveTensorBytes):
    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self.phase_starts: dict[str, int] = {}
        """Live bytes when each phase was first entered in this step."""

    def enter(self, phase: str | None) -> None:
        self.phase = phase
        if phase is not None:
            self.phase_starts.setdefault(phase, self.live)
        self._note_phase_peak()

    def start_step(self) -> None:
        """Forget the previous step's phase peaks (the overall ``peak`` is kept)."""
        self.phase = None
        self.phase_peaks = {}
        self.phase_starts = {}

    def _note_phase_peak(self) -> None:
        if self.phase is not None:
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.live)

    def _count(self, tensor: torch.Tensor) -> None:
        super()._count(tensor)
        if self.phase == "forward" and torch._C._current_autograd_node() is not None:
            self.enter("backward")
        self._note_phase_peak()


@dataclass
class StepMemory:
    """Bytes of live tensors on one rank, measured (``LiveTensorBytes``)."""

    between_steps: int
    """Held between two steady steps: weights, optimizer state, DeepSpeed's persistent buffers."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Peak of each phase of the last (steady) step."""
    phase_starts: dict[str, int] = field(default_factory=dict)
    """Live bytes as each phase of the last step began."""
    first_step_peak: int = 0
    """Peak over building the engine and the first step (the optimizer state is created in it)."""

    @property
    def peak(self) -> int:
        return max(self.phase_peaks.values())


def measure_step_memory(config: Config, steps: int = 3) -> StepMemory:
    """Build ``config``'s engine on this rank under ``PhaseMemory`` and take ``steps`` steps on
    synthetic tokens (``steps`` >= 2: the first is not steady)."""
    from lnstrain.benchmark.runners import synthetic_micro_batches
    from lnstrain.model.build import build_groups
    from lnstrain.training.engine import build_engine

    if steps < 2:
        raise ValueError("measure at least 2 steps: the first creates the optimizer state")
    tracker = PhaseMemory()
    with tracker:
        groups = build_groups(config)
        engine = build_engine(config, groups)
        engine.module.register_forward_pre_hook(lambda _module, _args: tracker.enter("forward"))
        micro_batches = synthetic_micro_batches(config, engine.accumulation_steps, groups.dp_rank)
        first_step_peak = 0
        for index in range(steps):
            tracker.start_step()
            engine.train_step(micro_batches, before_optimizer_step=lambda: tracker.enter("step"))
            tracker.enter(None)
            if index == 0:
                first_step_peak = tracker.peak
        return StepMemory(between_steps=tracker.live, phase_peaks=dict(tracker.phase_peaks),
                          phase_starts=dict(tracker.phase_starts), first_step_peak=first_step_peak)
