"""The GPU check's plan: what each call to a lent GPU runs, in order, and the seconds each item may take.

A session lent a GPU has 15 minutes of device time in all (machine start, every call and idle wait
included) and at most 10 minutes a command, so the check is planned as one decisive call of at most
``CALL_LIMIT_S`` seconds, the most valuable figures first; later calls are optional. Each item may run
for its ``seconds`` and is stopped there; an item starts only if its ``least_seconds`` fit in what is
left of the call (an earlier item that finished early leaves its slack to the later ones): all its
seconds for tests and the environment, ``BENCHMARK_START_SHARE`` of them for a benchmark, which then
runs in what is left and times fewer steps (on 2026-11-28 an earlier item's 6 s overrun left the last
item, the core tests, unstarted). ``tools/gpu_check.py
--plan`` prints a call's items and its total, which ``tests/benchmark/test_gpu_plan.py`` keeps within
the limit.

The seconds are allowances written before any GPU ran lnstrain, from the arithmetic of each item
(docs/performance.md, "The GPU check"): they hold the process start (torch and DeepSpeed imports, CUDA
context), building the model (the 1B model's deterministic CPU init runs on every core), warm-up and
timed steps; the benchmarks themselves stop timing early when their time runs short
(``tools/benchmark.py --time-limit-s``), so a slow step costs samples, not the item's figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CALL_LIMIT_S = 540
"""One call's budget: the device tool's 600 s per command, less a margin for the shell and the copy back."""

BENCHMARK_START_SHARE = 0.85
"""A benchmark item starts with this share of its seconds left (its ``--time-limit-s`` then cuts timed steps,
never below three a runner); a pytest item needs all of its seconds (cut short, its results are lost)."""

CONFIG_1B = "configs/bench/1b_seq2048.yaml"
CONFIG_7B_WIDTH = "configs/bench/7b_width_seq4096.yaml"
CONFIG_TINY = "configs/bench/tiny.yaml"


@dataclass(frozen=True)
class Item:
    """One item of a call.

    Attributes:
        name: the key its result is stored under in ``gpu_check.json``.
        call: 1 for the decisive first call, 2 and 3 for the optional later ones.
        seconds: how long it may run on the GPU machine, process start included.
        kind: ``environment`` (the probe and one engine step), ``tests`` (pytest) or ``benchmark``
            (``tools/benchmark.py``).
        issue_item: which of the issue's figures it gives, e.g. ``(b) (c)``.
        what: one line on what it measures.
        args: the pytest or ``tools/benchmark.py`` arguments.
        needs_engine: it builds a DeepSpeed engine, so it is skipped when the environment item's engine
            step failed (DeepSpeed missing or broken on this machine).
    """

    name: str
    call: int
    seconds: int
    kind: str
    issue_item: str
    what: str
    args: tuple[str, ...] = ()
    needs_engine: bool = False

    @property
    def least_seconds(self) -> int:
        """What must be left of the call for the item to start (module docstring)."""
        return math.ceil(self.seconds * BENCHMARK_START_SHARE) if self.kind == "benchmark" else self.seconds


def _bench(*args: str) -> tuple[str, ...]:
    return ("--baseline", "none", *args) if "--baseline" not in args else args


_EAGER = ("--set", "train.compile=false")
_FP8_LAYOUT = ("--set", "precision.dtype=bf16", "--set", "parallel.zero_stage=1")
"""What FP8 needs, named for the CPU dry run's fp32 tiny config (the 1B config has both already)."""


def _fp8_compiled(scaling: str) -> tuple[str, ...]:
    """The compiled 1B engine with float8 linears scaled ``scaling``-wise, 2 warm-up and 6 timed steps."""
    return ("--config", CONFIG_1B, *_bench("--set", "train.compile=true", *_FP8_LAYOUT, "--set",
                                           f"precision.fp8={scaling}", "--warmup", "2", "--steps", "6"))

SWITCHES_EAGER = "lns_factor,rotary_kernel,swiglu_kernel,fused_accumulation"
"""What the eager item leaves out in turn on its one engine (``lnstrain/benchmark/switches.py``): each change's
worth, and LNS against Pre-LN (LNS's factor off), interleaved with the engine as built."""
SWITCHES_COMPILED = "fused_accumulation,chunked_loss"
"""The compiled item's: the accumulation and the chunked loss, both outside the compiled layers, so switching
them compiles nothing again. Memory is read from the engine as built, before any runner with a switch off
has stepped. Both kernels off together (inductor's own fusion of the plain ops) recompiles every layer's
graphs (about a minute at 1B), so that comparison is an item of its own, in call 2."""

PLAN: tuple[Item, ...] = (
    Item("environment", 1, 50, "environment", "(a)",
         "the GPU, torch, CUDA, DeepSpeed (installed offline from .whl/), and one bf16 engine step on CUDA"),
    Item("1b_eager", 1, 100, "benchmark", "(b) (c) (e)",
         "1B LNS seq 2048 bf16, training layout (ZeRO 1, fp32 master weights and accumulation, 8 micro-batches of "
         "4), eager: a one-step kernel profile first, then tokens/s, MFU and memory against the --dry-run estimate, "
         "interleaved on the one engine with LNS's factor (Pre-LN), each Triton kernel and the fused accumulation "
         "left out in turn",
         ("--config", CONFIG_1B, *_bench(*_EAGER, "--switches", SWITCHES_EAGER, "--warmup", "2", "--steps", "8",
                                         "--profile-steps", "1")),
         needs_engine=True),
    Item("core_tests", 1, 110, "tests", "(d)",
         "the GPU suite's core: the SDPA kernel chosen, fused RMSNorm with the LNS factor, ring attention on "
         "FlashAttention's kernels, bf16 GPU against fp32 CPU engine steps, resume bit for bit on the GPU, the HF "
         "export",
         ("-m", "gpu and gpu_core", "tests/gpu")),
    Item("1b_compiled", 1, 150, "benchmark", "(b)",
         "the same, every transformer layer compiled (torch.compile, inductor, the default path): the first step "
         "compiles, a one-step kernel profile, then interleaved with the fused accumulation left out and with the "
         "loss's fp32 copy of the logits (fp32_logits)",
         ("--config", CONFIG_1B, *_bench("--set", "train.compile=true", "--switches", SWITCHES_COMPILED, "--warmup",
                                         "2", "--steps", "8", "--profile-steps", "1")),
         needs_engine=True),
    Item("1b_fp8_compiled", 1, 130, "benchmark", "(g)",
         "the compiled item's engine with float8 linears (precision.fp8=tensorwise): tokens/s against 1b_compiled's "
         "bf16, MFU against the bf16 peak, memory; no switch (turning FP8 off would compile the layers again)",
         _fp8_compiled("tensorwise"),
         needs_engine=True),
    Item("1b_compiled_kernels_off", 2, 200, "benchmark", "(b)",
         "the compiled default path interleaved on one engine with both Triton kernels left out (inductor's own "
         "fusion of the plain ops: every layer compiled a second time): whether the kernels beat inductor",
         ("--config", CONFIG_1B, *_bench("--set", "train.compile=true", "--switches", "rotary_kernel+swiglu_kernel",
                                         "--warmup", "2", "--steps", "6")),
         needs_engine=True),
    Item("1b_micro_batch_8", 2, 65, "benchmark", "(b) (c)",
         "the 1B training layout with 4 micro-batches of 8 instead of 8 of 4 (the same 65,536 tokens a step), "
         "eager: tokens/s, MFU and memory, against 1b_eager's",
         ("--config", CONFIG_1B, *_bench(*_EAGER, "--set", "train.micro_batch_size=8", "--warmup", "2", "--steps",
                                         "5")),
         needs_engine=True),
    Item("1b_vs_hf_model", 2, 45, "benchmark", "(f)",
         "lnstrain's model against transformers' LlamaForCausalLM, the same driver (torch AdamW, bf16 autocast), "
         "one micro-batch of 2 a step, eager (met in the first H100 call, 1.254x: a short check)",
         ("--config", CONFIG_1B, "--runner", "model", "--baseline", "hf", *_EAGER, "--set",
          "train.global_batch_size=2", "--set", "train.micro_batch_size=2", "--warmup", "2", "--steps", "4")),
    Item("1b_fp8_rowwise_compiled", 2, 140, "benchmark", "(g)",
         "as 1b_fp8_compiled with rowwise scales (precision.fp8=rowwise): its cost against tensorwise",
         _fp8_compiled("rowwise"),
         needs_engine=True),
    Item("1b_lns_vs_pre_ln", 2, 75, "benchmark", "(e)",
         "LNS against Pre-LN on one engine in the training layout, its norms' LNS factors switched between "
         "interleaved steps (the schemes differ only there), eager, alone and with more steps than 1b_eager's pair",
         ("--config", CONFIG_1B, *_bench("--schemes", "lns,pre_ln", "--same-engine", *_EAGER, "--warmup", "2",
                                         "--steps", "20")),
         needs_engine=True),
    Item("full_tests", 3, 240, "tests", "(d)", "the whole GPU suite", ("-m", "gpu", "tests/gpu")),
    Item("1b_paper_shape", 3, 95, "benchmark", "(b)",
         "the paper's 1B shape (FFN 5461, not a multiple of 64) in the training layout, eager",
         ("--config", CONFIG_1B, *_bench(*_EAGER, "--set", "model.ffn_multiple_of=1", "--warmup", "2", "--steps", "8")),
         needs_engine=True),
    Item("7b_width_2_layers", 3, 70, "benchmark", "-",
         "7B width (hidden 4096, FFN 11008) at seq 4096, 2 layers",
         ("--config", CONFIG_7B_WIDTH, *_bench(*_EAGER, "--set", "model.num_layers=2", "--warmup", "2", "--steps", "10")),
         needs_engine=True),
    Item("7b_width_4_layers", 3, 80, "benchmark", "-",
         "the same with 4 layers: the difference is one 7B layer's cost, projected to 32 layers",
         ("--config", CONFIG_7B_WIDTH, *_bench(*_EAGER, "--set", "model.num_layers=4", "--warmup", "2", "--steps", "10")),
         needs_engine=True),
    Item("1b_vs_hf_engine", 4, 55, "benchmark", "(f)",
         "lnstrain's DeepSpeed engine against LlamaForCausalLM, one micro-batch of 2 a step",
         ("--config", CONFIG_1B, "--baseline", "hf", *_EAGER, "--set", "train.global_batch_size=2", "--set",
          "train.micro_batch_size=2", "--warmup", "2", "--steps", "10"),
         needs_engine=True),
    Item("1b_memory_full", 4, 90, "benchmark", "(c)", "1B memory, activation checkpointing full",
         ("--config", CONFIG_1B, *_bench(*_EAGER, "--set", "train.activation_checkpointing=full", "--warmup", "2",
                                         "--steps", "3")),
         needs_engine=True),
    Item("1b_memory_selective", 4, 90, "benchmark", "(c)", "1B memory, activation checkpointing selective",
         ("--config", CONFIG_1B, *_bench(*_EAGER, "--set", "train.activation_checkpointing=selective", "--warmup",
                                         "2", "--steps", "3")),
         needs_engine=True),
)
ITEMS = {item.name: item for item in PLAN}
CALLS = sorted({item.call for item in PLAN})


def call_items(call: int) -> list[Item]:
    """The items of ``call``, in run order."""
    return [item for item in PLAN if item.call == call]


def call_total(call: int) -> int:
    return sum(item.seconds for item in call_items(call))


def plan_text(call: int, limit_s: float = CALL_LIMIT_S) -> str:
    """The call's items with their allowances, ending with the line ``total N s of L s``."""
    command = "bash launch/gpu_check.sh" + ("" if call == 1 else f" --call {call}")
    lines = [f"GPU check, call {call} ({command}): in this order, each stopped at its seconds, "
             "each started only if its seconds fit in what is left (a benchmark: "
             f"{BENCHMARK_START_SHARE:.0%} of them, then timing fewer steps)"]
    lines += [f"  {item.name:<20} {item.seconds:>4} s  {item.issue_item:<11} {item.what}" for item in call_items(call)]
    lines.append(f"total {call_total(call)} s of {limit_s:g} s")
    return "\n".join(lines)
