"""What gets timed: one optimizer step of a model on synthetic tokens.

Every runner trains on the same fixed random batch (``synthetic_micro_batches``): the data
pipeline is not part of the step (``tools/benchmark_data.py`` measures it). Kinds:

* ``engine``: the real lnstrain path, ``build_engine(config, groups).train_step`` (DeepSpeed,
  our optimizer, our clipping, any parallel layout).
* ``model``: the lnstrain ``Transformer`` with torch's AdamW and plain forward/backward/step, exactly
  as the Hugging Face baseline (``hf_baseline``) is driven, so the two compare models, not engines.
  Its step is split into forward, backward and optimizer time (cheap: one device sync per phase).

Mixed precision in the plain runners is torch autocast over fp32 weights (the DeepSpeed engine keeps
bf16 weights and fp32 master weights instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lnstrain.benchmark.switches import SWITCHES
from lnstrain.config.run_config import Config
from lnstrain.model.build import build_groups, build_model, select_triton_kernels
from lnstrain.model.config import NormScheme
from lnstrain.parallel.groups import ParallelGroups
from lnstrain.training.optimizer import adam_kernel

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward", "optimizer")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_micro_batches(config: Config, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` micro-batches of uniform random tokens, ``{"tokens": int64 [mb, seq + 1]}`` on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.train.micro_batch_size, config.data.seq_len + 1)
    return [{"tokens": torch.randint(0, config.model.vocab_size, shape, generator=generator)}
            for _ in range(count)]


def autocast_for(device: torch.device, dtype_name: str) -> contextlib.AbstractContextManager:
    """Autocast for ``precision.dtype`` in the plain runners: none for fp32, bf16 autocast for bf16."""
    if dtype_name == "fp32":
        return contextlib.nullcontext()
    if dtype_name == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision.dtype {dtype_name!r}: the model and hf runners support fp32 and bf16 "
                     "(fp16 needs loss scaling; use --runner engine)")


def adamw_for(params: list[nn.Parameter], config: Config, device: torch.device) -> torch.optim.AdamW:
    """torch AdamW with the config's hyper-parameters and lnstrain's kernel choice (``adam_kernel``)."""
    kernel = adam_kernel([device])
    optim = config.optim
    return torch.optim.AdamW(params, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             weight_decay=optim.weight_decay, **kernel)


def ensure_process_group(device: torch.device) -> None:
    """Join the launcher's process group, or make a one-rank group for a plain ``python`` launch."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        from lnstrain.parallel.local_ranks import single_rank_env

        os.environ.update(single_rank_env())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


class StepRunner(ABC):
    """One optimizer step per call of ``step`` (returns the loss, which waits for the device)."""

    kind: str

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.last_phases: dict[str, float] | None = None

    @abstractmethod
    def step(self) -> float: ...


class PlainRunner(StepRunner):
    """forward -> backward -> clip -> AdamW step over ``micro_batches``; subclasses give the loss."""

    def __init__(self, name: str, model: nn.Module, config: Config, device: torch.device,
                 micro_batches: list[dict[str, torch.Tensor]]) -> None:
        super().__init__(name, device)
        self.model = model.to(device).train()
        self.config = config
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw_for(self.params, config, device)
        tokens = [batch["tokens"].to(device) for batch in micro_batches]
        self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]

    @abstractmethod
    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def _mark(self, start: float, phase: str, phases: dict[str, float]) -> float:
        synchronize(self.device)
        now = time.perf_counter()
        phases[phase] += now - start
        return now

    def step(self) -> float:
        phases = dict.fromkeys(PHASES, 0.0)
        total = torch.zeros((), device=self.device)
        now = time.perf_counter()
        for inputs, labels in self.batches:
            with autocast_for(self.device, self.config.precision.dtype):
                loss = self.loss(inputs, labels) / len(self.batches)
            now = self._mark(now, "forward", phases)
            loss.backward()
            total += loss.detach()
            now = self._mark(now, "backward", phases)
        if self.config.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.optim.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._mark(now, "optimizer", phases)
        self.last_phases = phases
        return total.item()


class ModelRunner(PlainRunner):
    """The lnstrain ``Transformer`` (single process) driven like the baseline."""

    kind = "model"

    def __init__(self, name: str, config: Config, device: torch.device,
                 micro_batches: list[dict[str, torch.Tensor]]) -> None:
        model = build_model(config, ParallelGroups.single_process(), device.type)
        super().__init__(name, model, config, device, micro_batches)
        select_triton_kernels(self.model, device, config.precision.compute_dtype)

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model.loss(inputs, labels)


class EngineRunner(StepRunner):
    """``TrainingEngine.train_step``: the DeepSpeed engine lnstrain trains with."""

    kind = "engine"

    def __init__(self, name: str, config: Config, micro_batches: list[dict[str, torch.Tensor]],
                 device: torch.device) -> None:
        from lnstrain.training.engine import build_engine

        ensure_process_group(device)
        groups = build_groups(config)
        self.engine = build_engine(config, groups)
        super().__init__(name, self.engine.device)
        self.micro_batches = micro_batches

    def step(self) -> float:
        return self.engine.train_step(self.micro_batches).loss


SWITCHED_SCHEMES = ("lns", "pre_ln")
"""The schemes one engine can be timed as (``SchemeSwitch``): they differ only in the pre-sublayer
norms' output factor (``norm_schemes.block_layout``)."""


class SchemeSwitch:
    """One LNS engine timed as LNS and as Pre-LN: the two differ only in the pre-sublayer norms' output
    factor, 1/√ℓ against 1, and a norm whose factor is 1 skips the multiply, as a Pre-LN model's does. So
    switching the factors between steps times both code paths on the same weights, memory and allocator
    state, and the pair's step-time ratio is the factor's cost alone (the weights train as neither
    scheme: a benchmark's numbers, not a model). Eager only: a compiled layer specialises on the
    factor."""

    def __init__(self, runner: EngineRunner) -> None:
        from lnstrain.model.norms import LayerNorm, RMSNorm

        self.runner = runner
        self.lns_factors = [(norm, norm.output_scale) for norm in runner.engine.module.modules()
                            if isinstance(norm, (RMSNorm, LayerNorm)) and norm.output_scale != 1.0]
        if not self.lns_factors:
            raise ValueError("the engine's model has no norm with an LNS factor: build it with norm_scheme lns")

    def set_scheme(self, scheme: str) -> None:
        if scheme not in SWITCHED_SCHEMES:
            raise ValueError(f"scheme {scheme!r}: one engine switches between {SWITCHED_SCHEMES} only")
        for norm, factor in self.lns_factors:
            norm.output_scale = factor if scheme == "lns" else 1.0

    def as_scheme(self, name: str, scheme: str) -> StepRunner:
        return SwitchedRunner(name, self, scheme)


class SwitchedRunner(StepRunner):
    """A ``SchemeSwitch``'s engine stepped as one scheme."""

    kind = "engine"

    def __init__(self, name: str, switch: SchemeSwitch, scheme: str) -> None:
        super().__init__(name, switch.runner.device)
        self.switch = switch
        self.scheme = scheme

    def step(self) -> float:
        self.switch.set_scheme(self.scheme)
        return self.switch.runner.step()


class SwitchUnavailable(Exception):
    """A runner's switch cannot be turned off on this engine (it is not on its default path)."""


class SwitchBoard:
    """One engine stepped with chosen changes switched off (``lnstrain.benchmark.switches``): each of its
    runners sets every switch the board knows before its step, all on but its own, so that interleaved
    runners compare the default path with each change left out, on the same weights, memory and allocator.
    The weights train as a mixture of the runners' paths: a benchmark's numbers, not a model."""

    def __init__(self, runner: EngineRunner, names: list[str]) -> None:
        self.runner = runner
        self.switches = [SWITCHES[name] for name in sorted(set(names))]
        self.unavailable = {switch.name: switch.unavailable(runner.engine) for switch in self.switches}
        graphs_per_setting = 2  # a compiled LNS layer: layer 1 (factor 1.0) and every other layer
        for name in ("recompile_limit", "cache_size_limit"):
            limit = getattr(torch._dynamo.config, name, None)
            if limit is not None:
                setattr(torch._dynamo.config, name, max(limit, graphs_per_setting * (len(self.switches) + 1) * 2))

    def runner_for(self, name: str, off: tuple[str, ...]) -> StepRunner:
        reasons = [f"{switch}: {self.unavailable[switch]}" for switch in off if self.unavailable.get(switch)]
        if reasons:
            raise SwitchUnavailable("; ".join(reasons))
        scheme = next((SWITCHES[switch].scheme_without for switch in off if SWITCHES[switch].scheme_without), None)
        return BoardRunner(name, self, off, scheme or NormScheme(self.runner.engine.config.model.norm_scheme).value)

    def set_off(self, off: tuple[str, ...]) -> None:
        for switch in self.switches:
            if self.unavailable[switch.name] is None:
                switch.turn(self.runner.engine, switch.name not in off)


class BoardRunner(StepRunner):
    """A ``SwitchBoard``'s engine stepped with the switches ``off`` turned off and the rest on."""

    kind = "engine"

    def __init__(self, name: str, board: SwitchBoard, off: tuple[str, ...], scheme: str) -> None:
        super().__init__(name, board.runner.device)
        self.board = board
        self.off = off
        self.scheme = scheme

    def step(self) -> float:
        self.board.set_off(self.off)
        return self.board.runner.step()


@dataclass(frozen=True)
class RunnerSpec:
    """A runner to build: its kind (``engine``, ``model``, ``hf``) and the config it runs."""

    name: str
    kind: str
    config: Config


def with_norm_scheme(config: Config, scheme: str) -> Config:
    """``config`` with ``model.norm_scheme`` replaced (the model section is copied, not shared)."""
    return config.replace(model=dataclasses.replace(config.model, norm_scheme=NormScheme(scheme)))
