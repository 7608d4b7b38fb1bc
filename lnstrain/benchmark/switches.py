"""The changes to the training step that one engine can switch off and on between steps, so that one
benchmark call says what each is worth (``tools/benchmark.py --switches``).

Each entry of ``SWITCHES`` is one change: its name, what the engine runs without it, why it cannot be
switched on a given engine (None when it can), and how to turn it on or off on a built ``TrainingEngine``.
"On" is the engine as ``build_engine`` made it (the default path); "off" is the path the change replaced.
A switch changes no weight, optimizer state or checkpoint: it selects code. The runners that step an
engine with some switches off are ``runners.SwitchBoard``'s. A new change is one more ``Switch`` here.
FP8 linears are opt-in, not the default path: their switch needs an engine built with ``precision.fp8``,
and times it against the same engine's bf16 linears (``--set precision.fp8=tensorwise --switches fp8``).

Switching a change that lives inside compiled layers (the Triton kernels, FP8) makes dynamo compile
those layers again the first time, as a guard on the switched attribute fails; ``SwitchBoard`` raises
dynamo's recompile limit so that every combination keeps its graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lnstrain.model.block import TransformerBlock
from lnstrain.model.build import TRITON_KERNELS, set_fp8_mode, set_triton_kernel

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine


@dataclass(frozen=True)
class Switch:
    """One change that a built engine can run with or without.

    Attributes:
        name: how ``--switches`` names it.
        without: what the engine runs when it is off.
        unavailable: why it cannot be switched on this engine (it is not part of its default path), or None.
        turn: turn it on (the engine's default) or off.
        scheme_without: the norm scheme the engine computes with it off, where that differs (LNS's factor).
    """

    name: str
    without: str
    unavailable: Callable[[TrainingEngine], str | None]
    turn: Callable[[TrainingEngine, bool], None]
    scheme_without: str | None = None


def _lns_norms(engine: TrainingEngine):
    """(norm, its LNS factor) for every pre-sublayer norm of the engine's layers whose factor is not 1."""
    return [(getattr(block, name), block.layout.norm_output_scale)
            for block in engine.module.modules() if isinstance(block, TransformerBlock)
            for name in ("attention_norm", "mlp_norm") if block.layout.norm_output_scale != 1.0]


def _turn_lns_factor(engine: TrainingEngine, on: bool) -> None:
    for norm, factor in _lns_norms(engine):
        norm.output_scale = factor if on else 1.0


def _kernel_usable(engine: TrainingEngine, kernel: str) -> bool:
    _, usable = TRITON_KERNELS[kernel]
    return usable(engine.device, engine.config.precision.compute_dtype)


def _kernel_switch(name: str, kernel: str, without: str) -> Switch:
    def unavailable(engine: TrainingEngine) -> str | None:
        if _kernel_usable(engine, kernel):
            return None
        return (f"the {kernel} Triton kernel is not used on {engine.device} in {engine.config.precision.dtype} "
                "(no Triton there, or its bitwise check against the eager ops failed)")

    return Switch(name, without, unavailable,
                  lambda engine, on: set_triton_kernel(engine.module, kernel, on and _kernel_usable(engine, kernel)))


def _turn_chunked_loss(engine: TrainingEngine, on: bool) -> None:
    # the engine, the model and the pipeline's loss share this config section and read it at every call
    engine.config.model.cross_entropy = "chunked" if on else "fp32_logits"


def _turn_fp8(engine: TrainingEngine, on: bool) -> None:
    set_fp8_mode(engine.module, engine.config.precision.fp8 if on else "none")


SWITCHES: dict[str, Switch] = {switch.name: switch for switch in (
    Switch("lns_factor", "Pre-LN: every norm's factor 1, its multiply skipped (the schemes differ only there)",
           lambda engine: None if _lns_norms(engine) else "the model has no norm with an LNS factor (norm_scheme lns)",
           _turn_lns_factor, scheme_without="pre_ln"),
    _kernel_switch("rotary_kernel", "rotary", "the q|k|v rotation by eager ops (compiled: plain ops inductor fuses)"),
    _kernel_switch("swiglu_kernel", "swiglu", "SwiGLU by eager ops (compiled: plain ops inductor fuses)"),
    Switch("fused_accumulation", "DeepSpeed's own bf16 gradient add (cast, then add, per parameter) and clipping",
           lambda engine: None if engine.fused_accumulation is not None else
           "the engine's optimizer is not DeepSpeed's BF16_Optimizer (bf16 with fp32 accumulation at ZeRO 1)",
           lambda engine, on: engine.fused_accumulation.set_enabled(on)),
    Switch("chunked_loss", "the cross-entropy over an fp32 copy of the logits, keeping fp32 log-probabilities "
           "(model.cross_entropy: fp32_logits)",
           lambda engine: None if engine.config.model.cross_entropy == "chunked" else
           "the engine's loss is model.cross_entropy: fp32_logits already",
           _turn_chunked_loss),
    Switch("fp8", "bf16 linear layers (precision.fp8: none)",
           lambda engine: None if engine.config.precision.fp8 != "none" else
           "the engine computes without float8 (build it with --set precision.fp8=tensorwise or rowwise to time "
           "float8 against bf16)",
           _turn_fp8),
)}


def parse_switch_sets(text: str) -> list[tuple[str, ...]]:
    """``--switches a,b+c`` -> [("a",), ("b", "c")]: each set is switched off together in one runner."""
    return [tuple(name.strip() for name in part.split("+") if name.strip()) for part in text.split(",") if part.strip()]


def unknown_switches(sets: list[tuple[str, ...]]) -> list[str]:
    return sorted({name for names in sets for name in names if name not in SWITCHES})
