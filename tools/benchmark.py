#!/usr/bin/env python
"""Training-step throughput of lnstrain, beside Hugging Face LLaMA and across norm schemes.

    python tools/benchmark.py --config configs/bench/cpu_small.yaml --json bench.json
    python tools/benchmark.py --config configs/bench/1b_seq2048.yaml --schemes lns,pre_ln   # one GPU
    deepspeed --num_gpus 8 tools/benchmark.py --config configs/bench/1b_seq2048.yaml --baseline none

Every runner trains on a fixed random batch (the data pipeline is excluded). After --warmup steps
each, the runners take --steps steps interleaved (A B, B A, ...) so that load on a shared machine
hits all alike; the report gives the median step time, tokens/s (global and per device), achieved
TFLOP/s and MFU with FLOPs per token 6N + 12·L·h·s (attention non-causal, the Megatron-LM /
torchtitan / OLMo convention; causal figures beside), a forward/backward/optimizer split for the
plain runners, paired step-time ratios against the first runner with 95% intervals, and the peak
memory next to the --dry-run estimate. Exit status 2: a bad config or option, nothing was timed.

--switches times one engine with each change of the default path left out in turn (the Triton kernels,
the fused gradient accumulation, LNS's factor, the chunked loss: ``lnstrain/benchmark/switches.py``),
interleaved with the engine as built, so that one call says what each change is worth:

    python tools/benchmark.py --config configs/bench/1b_seq2048.yaml --baseline none \
        --switches lns_factor,rotary_kernel,swiglu_kernel,fused_accumulation,chunked_loss --profile-steps 1
    python tools/benchmark.py --config configs/bench/1b_seq2048.yaml --baseline none \
        --set precision.fp8=tensorwise --switches fp8        # float8 linears against bf16, one engine

--profile-steps profiles the first runner right after its warm-up, before any other runner is built or
timed, and writes that profile at once beside the report (``<report>.profile.json``), so that it survives
whatever happens later. The JSON report is written (whole, or not at all) as soon as the figures exist,
before anything is torn down; once it and the table are out, the process ends without the interpreter's
exit (inductor's compile-worker pool shutdown waits on its worker processes, and DeepSpeed's engine tears
itself down), so a caller that stops the process at its time still finds the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lnstrain.benchmark.hf_baseline import BaselineUnavailable, HFRunner, transformers_version  # noqa: E402
from lnstrain.benchmark.memory import memory_report, peak_memory, reset_peak, tensor_tracker  # noqa: E402
from lnstrain.benchmark.peak import resolve_peak  # noqa: E402
from lnstrain.benchmark.profile import profile_steps  # noqa: E402
from lnstrain.benchmark.report import (SCHEMA, environment, flops_section, format_report,  # noqa: E402
                                       peak_section, shape, triton_kernels)
from lnstrain.benchmark.runners import (SWITCHED_SCHEMES, EngineRunner, ModelRunner, RunnerSpec,  # noqa: E402
                                        SchemeSwitch, StepRunner, SwitchBoard, SwitchUnavailable,
                                        synthetic_micro_batches, with_norm_scheme)
from lnstrain.benchmark.switches import SWITCHES, parse_switch_sets, unknown_switches  # noqa: E402
from lnstrain.benchmark.throughput import throughput  # noqa: E402
from lnstrain.benchmark.timing import interleaved_order, paired_ratio, summarize  # noqa: E402
from lnstrain.config.feasibility import compiles_layers  # noqa: E402
from lnstrain.config.loader import ConfigError, add_override_argument  # noqa: E402
from lnstrain.config.run_config import Config, load_config  # noqa: E402
from lnstrain.estimate.flops import flops_per_token  # noqa: E402
from lnstrain.estimate.validation import split_file_problems  # noqa: E402
from lnstrain.model.config import NormScheme  # noqa: E402
from lnstrain.parallel.groups import collective_device  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="run description (YAML); data files are not needed")
    add_override_argument(parser, "train.compile=true")
    parser.add_argument("--runner", choices=("engine", "model"), default="engine",
                        help="lnstrain side: the DeepSpeed training engine (default) or the bare model with "
                             "torch AdamW, driven exactly like the baseline")
    parser.add_argument("--baseline", choices=("auto", "hf", "none"), default="auto",
                        help="Hugging Face LlamaForCausalLM of the same shape: auto = when transformers is "
                             "installed and the run has one rank")
    parser.add_argument("--schemes", default=None,
                        help="comma-separated norm schemes to time side by side, e.g. lns,pre_ln "
                             "(default: the config's)")
    parser.add_argument("--same-engine", action="store_true",
                        help="with --schemes lns,pre_ln: time both on one engine, switching its norms' LNS "
                             "factors between steps (the schemes differ only there), so that weights, memory and "
                             "allocator state are the same for both and the ratio is the factor's cost; eager only")
    parser.add_argument("--switches", default=None, metavar="SETS",
                        help="time one engine as built and, interleaved, with each comma-separated switch turned "
                             "off (a+b: both off in one runner), e.g. rotary_kernel,swiglu_kernel,fused_accumulation; "
                             f"known: {', '.join(SWITCHES)}. Runners after the first take one warm-up step (compiled "
                             "layers recompile there)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per runner (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner (default 10)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak bf16 TFLOP/s per device for MFU (default: detected from the GPU name)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice, one per core)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps of the first runner (torch.profiler) right after its warm-up, "
                             "before anything else is built or timed, and report the operators/kernels by self time "
                             "(written at once to <--json>.profile.json)")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="stop taking timed steps (keeping at least 3 per runner) when the next round would end "
                             "past this many seconds after the process started (its imports included); the report "
                             "says how many steps it timed")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON here (rank 0)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def fail(problems: list[str], source: str) -> None:
    lines = "\n".join(f"  - {problem}" for problem in problems)
    print(f"benchmark: {len(problems)} problem(s) in {source}; nothing was timed:\n{lines}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def pick_device(choice: str) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("benchmark: --device cuda but torch sees no CUDA device")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def check_options(args: argparse.Namespace, config: Config, world_size: int) -> tuple[list[str], list[str]]:
    """(problems, schemes): every problem with the options and the config, found before anything runs."""
    problems, _missing_data = split_file_problems(config, world_size)
    if args.warmup < 0 or args.steps < 1:
        problems.append(f"--warmup must be >= 0 and --steps >= 1 (got {args.warmup}, {args.steps})")
    if args.time_limit_s is not None and args.time_limit_s <= 0:
        problems.append(f"--time-limit-s must be > 0 (got {args.time_limit_s})")
    if args.profile_steps < 0:
        problems.append(f"--profile-steps must be >= 0 (got {args.profile_steps})")
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads must be >= 1 (got {args.threads})")
    schemes = args.schemes.split(",") if args.schemes else [NormScheme(config.model.norm_scheme).value]
    known = [s.value for s in NormScheme]
    problems += [f"--schemes: unknown norm scheme {s!r}; known: {', '.join(known)}" for s in schemes if s not in known]
    if args.same_engine:
        if sorted(schemes) != sorted(SWITCHED_SCHEMES) or args.runner != "engine":
            problems.append(f"--same-engine times --schemes {','.join(SWITCHED_SCHEMES)} on --runner engine (got "
                            f"--schemes {','.join(schemes)}, --runner {args.runner})")
        if compiles_layers(config, pick_device(args.device).type):
            problems.append("--same-engine: a compiled layer specialises on the LNS factor; add --set "
                            "train.compile=false")
    if args.switches is not None:
        sets = parse_switch_sets(args.switches)
        if not sets:
            problems.append("--switches: name at least one switch")
        if unknown_switches(sets):
            problems.append(f"--switches: unknown {', '.join(unknown_switches(sets))}; known: {', '.join(SWITCHES)}")
        if args.runner != "engine" or args.same_engine or len(schemes) != 1:
            problems.append("--switches times one engine (--runner engine, one scheme, without --same-engine)")
    if args.runner == "model" and world_size > 1:
        problems.append("--runner model is single-process; launch it with python, or use --runner engine")
    if args.baseline == "hf" and transformers_version() is None:
        problems.append("--baseline hf: transformers is not installed (pip install 'lnstrain[hf]')")
    return problems, schemes


def runner_specs(args: argparse.Namespace, config: Config, schemes: list[str], world_size: int,
                 notes: list[str]) -> list[RunnerSpec]:
    if args.same_engine:
        lns = with_norm_scheme(config, "lns")
        return [RunnerSpec(f"lnstrain-engine[{s}, one engine]", f"switched:{s}", lns) for s in schemes]
    if args.switches is not None:
        scheme = with_norm_scheme(config, schemes[0])
        if args.baseline == "hf":
            notes.append("Hugging Face baseline skipped: --switches times one engine")
        return [RunnerSpec(f"lnstrain-engine[{schemes[0]}]", "board:", scheme)] + [
            RunnerSpec(f"lnstrain-engine[{schemes[0]}] without {'+'.join(off)}", "board:" + "+".join(off), scheme)
            for off in parse_switch_sets(args.switches)]
    specs = [RunnerSpec(f"lnstrain-{args.runner}[{s}]", args.runner, with_norm_scheme(config, s)) for s in schemes]
    if args.baseline == "none":
        return specs
    if world_size > 1:
        notes.append("Hugging Face baseline skipped: it runs on one rank only (launch with python)")
    elif transformers_version() is None:
        notes.append("Hugging Face baseline skipped: transformers is not installed (pip install 'lnstrain[hf]')")
    else:
        specs.append(RunnerSpec("hf-llama", "hf", with_norm_scheme(config, "pre_ln")))
    return specs


def build_runner(spec: RunnerSpec, world_size: int, rank_seed: int, device: torch.device,
                 switches: dict | None = None, switch_names: list[str] | None = None) -> StepRunner:
    """The runner ``spec`` names; ``switched:<scheme>`` runners share the one engine kept in ``switches``, and so
    do ``board:<a+b>`` runners (the ``SwitchBoard`` of ``switch_names``)."""
    accumulation = spec.config.grad_accumulation_steps(world_size)
    batches = synthetic_micro_batches(spec.config, accumulation, rank_seed)
    if spec.kind.startswith("board:"):
        switches = {} if switches is None else switches
        if "board" not in switches:
            switches["board"] = SwitchBoard(EngineRunner("engine", spec.config, batches, device), switch_names or [])
        off = tuple(name for name in spec.kind.removeprefix("board:").split("+") if name)
        return switches["board"].runner_for(spec.name, off)
    if spec.kind.startswith("switched:"):
        switches = {} if switches is None else switches
        if "engine" not in switches:
            switches["engine"] = SchemeSwitch(EngineRunner("lns engine", spec.config, batches, device))
        return switches["engine"].as_scheme(spec.name, spec.kind.removeprefix("switched:"))
    if spec.kind == "engine":
        return EngineRunner(spec.name, spec.config, batches, device)
    if spec.kind == "model":
        return ModelRunner(spec.name, spec.config, device, batches)
    return HFRunner(spec.name, spec.config, device, batches)


MIN_TIMED_STEPS = 3
"""Timed steps per runner that ``--time-limit-s`` never cuts below."""


def time_interleaved(runners: list[StepRunner], steps: int, deadline: float | None = None) -> dict[str, list]:
    """Per-runner wall and process-CPU seconds per step, phase splits and last loss; the runners take
    their steps in a balanced order (``timing.interleaved_order``). CPU seconds (all threads of this
    process) do not count time spent waiting for a core, so on a shared CPU they compare runners when wall time cannot. With a
    ``deadline`` (``time.monotonic()``), no round starts that the previous round's length says would
    end past it, once ``MIN_TIMED_STEPS`` rounds are done (every rank decides alike: the slowest rank's
    round length is what each sees, since the ranks wait for each other in every step)."""
    wall: list[list[float]] = [[] for _ in runners]
    cpu: list[list[float]] = [[] for _ in runners]
    phases: list[list[dict]] = [[] for _ in runners]
    losses = [float("nan")] * len(runners)
    last_round = 0.0
    for step in range(steps):
        if deadline is not None and step >= MIN_TIMED_STEPS and _past(time.monotonic() + last_round, deadline):
            break
        round_start = time.monotonic()
        for index in interleaved_order(len(runners), step):
            runner = runners[index]
            start, start_cpu = time.perf_counter(), time.process_time()
            losses[index] = runner.step()
            wall[index].append(time.perf_counter() - start)
            cpu[index].append(time.process_time() - start_cpu)
            if runner.last_phases is not None:
                phases[index].append(runner.last_phases)
        last_round = time.monotonic() - round_start
    return {"wall": wall, "cpu": cpu, "phases": phases, "losses": losses}


def _past(moment: float, deadline: float) -> bool:
    """Whether ``moment`` is past ``deadline`` on any rank (one decision for all ranks)."""
    past = moment > deadline
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(past)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        past = bool(flag.item())
    return past


def slowest_rank(seconds: list[list[float]]) -> list[list[float]]:
    """Each step's time on the slowest rank (the step is as slow as its slowest rank)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return seconds
    table = torch.tensor(seconds, dtype=torch.float64, device=collective_device())
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.tolist()


def median_phases(phases: list[dict]) -> dict[str, float] | None:
    if not phases:
        return None
    return {key: float(torch.tensor([p[key] for p in phases]).median()) for key in phases[0]}


def process_started() -> float:
    """When this process started, on ``time.monotonic``'s clock: from ``/proc/self/stat`` on Linux, so that
    the interpreter's start and the imports count; elsewhere, now."""
    try:
        with open("/proc/self/stat", encoding="utf-8") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # from field 3 of proc(5) on: the name may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()
    return time.monotonic() - max(age, 0.0)


PROFILE_SCHEMA = "lnstrain.benchmark.profile/1"


def profile_path(report_path: str) -> str:
    """Where the first runner's profile is written beside the report at ``report_path``."""
    path = Path(report_path)
    return str(path.with_name(f"{path.stem}.profile.json"))


def write_report(doc: dict, path: str) -> None:
    """Write ``doc`` as JSON to ``path`` whole or not at all (a reader never sees half of it)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, target)


def leave(code: int = 0) -> NoReturn:
    """End the process now that its report is out: the process group is destroyed (quick; NCCL warns
    when it is not), the output flushed, and the interpreter's exit skipped: its handlers shut down
    inductor's compile-worker pool (waiting up to 300 s on the pool's sidecar process) and its finalizers
    run the DeepSpeed engine's ``destroy``. The sidecar sees its pipe close when this process ends and
    stops its workers."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, started: float | None = None) -> dict:
    """Run the benchmark; the report. ``started`` (``time.monotonic``) is where ``--time-limit-s`` counts
    from: by default the call of this function."""
    started = time.monotonic() if started is None else started
    args = parse_args(argv)
    deadline = None if args.time_limit_s is None else started + args.time_limit_s
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    try:
        config = load_config(args.config, args.overrides, world_size, validate=False)
    except ConfigError as error:
        fail(error.problems, args.config)
    problems, schemes = check_options(args, config, world_size)
    if problems:
        fail(problems, args.config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    peak = resolve_peak(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", args.peak_tflops)
    notes: list[str] = []
    specs = runner_specs(args, config, schemes, world_size, notes)

    runners: list[tuple[RunnerSpec, StepRunner]] = []
    switches: dict = {}
    switch_names = sorted({name for off in parse_switch_sets(args.switches or "") for name in off})
    memory = profile = None
    for index, spec in enumerate(specs):
        reset_peak(device)
        tracker = tensor_tracker(device) if index == 0 else None
        with tracker or contextlib.nullcontext():  # the first runner's build and warm-up steps only: the timed steps run untracked
            try:
                runner = build_runner(spec, world_size, args.seed + rank, device, switches, switch_names)
            except (BaselineUnavailable, SwitchUnavailable) as error:
                notes.append(f"{spec.name} skipped: {error}")
                continue
            # a board's later runners share the warm engine: one step each (where compiled layers recompile)
            for _ in range(args.warmup if index == 0 or not spec.kind.startswith("board:") else min(args.warmup, 1)):
                runner.step()
        if index == 0:
            memory = memory_report(spec.config, world_size, device, runner.kind, peak_memory(device, tracker),
                                   warmup_steps=args.warmup)
            if args.profile_steps:
                profile = profile_steps(runner.step, args.profile_steps, device)
                if rank == 0 and args.json:  # first, so that nothing later can lose it
                    write_report({"schema": PROFILE_SCHEMA, "runner": spec.name,
                                  "command": shlex.join(["python", "tools/benchmark.py",
                                                         *(sys.argv[1:] if argv is None else argv)]),
                                  "environment": environment(device, world_size),
                                  "shape": shape(config, world_size, device.type), "profile": profile},
                                 profile_path(args.json))
        runners.append((spec, runner))
    timed = time_interleaved([runner for _, runner in runners], args.steps, deadline)
    seconds, cpu_seconds = slowest_rank(timed["wall"]), timed["cpu"]
    timed_steps = len(seconds[0]) if seconds else 0
    if timed_steps < args.steps:
        notes.append(f"--time-limit-s {args.time_limit_s:g}: timed {timed_steps} of {args.steps} steps per runner")
    on_cpu = device.type == "cpu"

    flops = flops_per_token(config.model, config.data.seq_len)
    results = []
    for (spec, runner), times, cpu_times, split, loss in zip(runners, seconds, cpu_seconds, timed["phases"],
                                                             timed["losses"]):
        timing = summarize(times)
        rate = throughput(timing.median, config.tokens_per_step, flops, world_size, peak.tflops)
        results.append({"name": runner.name, "kind": runner.kind,
                        "norm_scheme": getattr(runner, "scheme", None) or NormScheme(spec.config.model.norm_scheme).value,
                        "step_time_s": timing.to_dict(), "throughput": rate.to_dict(),
                        "cpu_time_s": summarize(cpu_times).to_dict() if on_cpu else None,
                        "breakdown_s": median_phases(split), "last_loss": loss})
    comparisons = []
    for run, times, cpu_times in zip(results[1:], seconds[1:], cpu_seconds[1:]):
        comparison = paired_ratio(run["name"], times, results[0]["name"], seconds[0]).to_dict()
        if on_cpu:
            by_cpu = paired_ratio(run["name"], cpu_times, results[0]["name"], cpu_seconds[0])
            comparison.update(cpu_time_median_ratio=by_cpu.median_ratio, cpu_time_ci95=list(by_cpu.ci95))
        comparisons.append(comparison)
    doc = {
        "schema": SCHEMA,
        "command": shlex.join(["python", "tools/benchmark.py", *(sys.argv[1:] if argv is None else argv)]),
        "environment": environment(device, world_size),
        "shape": shape(config, world_size, device.type),
        "flops": flops_section(flops),
        "peak": peak_section(peak, config.precision.fp8),
        "protocol": {"warmup_steps": args.warmup, "timed_steps": timed_steps, "requested_steps": args.steps,
                     "order": "interleaved, Williams design",
                     "data": "fixed synthetic batch", "step_time": "slowest rank per step"},
        "runners": results,
        "comparisons": comparisons,
        "memory": memory,
        "triton_kernels": triton_kernels(device, config.precision.dtype),
        "switches": {"off_by_runner": {runner.name: list(getattr(runner, "off", ())) for _, runner in runners},
                     "without": {name: SWITCHES[name].without for name in switch_names}} if switch_names else None,
        "notes": notes,
    }
    if profile is not None:
        doc["profile"] = profile
    if rank == 0:
        if args.json:
            write_report(doc, args.json)
        print(format_report(doc), flush=True)
    return doc


if __name__ == "__main__":
    main(started=process_started())
    leave(0)
