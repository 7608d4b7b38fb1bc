#!/usr/bin/env python
"""The GPU check of issue 12: environment, the GPU test suite and the benchmarks, in stages, into one
JSON document and a short Markdown table (``lnstrain/benchmark/gpu_summary.py``).

    bash launch/gpu_check.sh --only tests,memory          # installs a carried .whl/ first, then runs this
    python tools/gpu_check.py --only throughput --out results/
    python tools/gpu_check.py --dry-run --out /tmp/dry     # the CPU, tiny shapes: the plumbing, no GPU figure
    python tools/gpu_check.py --summarize a/gpu_check.json b/gpu_check.json --out results/

Stages, in this order (default: all): tests (pytest -m gpu tests/gpu), memory (1B with activation
checkpointing full and selective), throughput (1B LNS eager with a profile, compiled, and with the FFN
rounded to 5632), compare (lnstrain model and engine against Hugging Face LLaMA, LNS against Pre-LN),
layers7b (7B width at two depths). The environment is recorded first in every call.

Each benchmark is a ``tools/benchmark.py`` subprocess (a crash or OOM loses that item only). The
results (gpu_check.json, gpu_check.md) and the whole output (gpu_check.log) are rewritten in --out
after every item, so a call cut short keeps what it finished. --time-limit-s (default 540, inside
the lent machine's 10 minutes per command) stops starting items that would not finish; they are
recorded as not started, to run with --only in the next call.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lnstrain.benchmark.gpu_summary import (BENCHMARKS, SCHEMA, merge_documents, summary_json,  # noqa: E402
                                            to_markdown)
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

STAGES = ("tests", "memory", "throughput", "compare", "layers7b")
EXIT_BAD_INPUT = 2
CONFIG_1B = "configs/bench/1b_seq2048.yaml"
CONFIG_7B = "configs/bench/7b_width_seq4096.yaml"
CONFIG_TINY = "configs/bench/tiny.yaml"
CONFIG_TINY_WIDE = "configs/bench/tiny_wide.yaml"  # the dry run's depth pair: layers dominate its step
DRY_RUN_TESTS = "tests/gpu/test_kernels_on_device.py"
OUTPUT_TAIL_LINES = 40


@dataclass(frozen=True)
class Benchmark:
    """One ``tools/benchmark.py`` run: its stage, arguments, and the seconds it needs at least on a GPU."""

    name: str
    stage: str
    args: tuple[str, ...]
    min_seconds: float


def benchmarks(dry_run: bool) -> list[Benchmark]:
    """Every benchmark, in run order; the dry run swaps in the tiny shape and a few steps on the CPU."""
    big, wide = (CONFIG_TINY, CONFIG_TINY_WIDE) if dry_run else (CONFIG_1B, CONFIG_7B)
    ffn = "96" if dry_run else "5632"

    def steps(count: int, warmup: int = 3) -> tuple[str, ...]:
        return ("--warmup", "2", "--steps", "3") if dry_run else ("--warmup", str(warmup), "--steps", str(count))

    alone = ("--baseline", "none")
    specs = [
        Benchmark("1b_memory_full", "memory", ("--config", big, *alone, *steps(3, 2), "--set",
                                               "train.activation_checkpointing=full"), 90),
        Benchmark("1b_memory_selective", "memory", ("--config", big, *alone, *steps(3, 2), "--set",
                                                    "train.activation_checkpointing=selective"), 90),
        Benchmark("1b_eager", "throughput", ("--config", big, *alone, *steps(20), "--profile-steps", "3"), 90),
        Benchmark("1b_compiled", "throughput", ("--config", big, *alone, *steps(20), "--set", "train.compile=true"), 240),
        Benchmark("1b_ffn5632", "throughput", ("--config", big, *alone, *steps(20), "--set",
                                               f"model.ffn_hidden_size={ffn}"), 90),
        Benchmark("1b_vs_hf_model", "compare", ("--config", big, "--runner", "model", "--baseline", "hf", *steps(20)), 150),
        Benchmark("1b_vs_hf_engine", "compare", ("--config", big, "--baseline", "hf", *steps(20)), 150),
        Benchmark("1b_lns_vs_pre_ln", "compare", ("--config", big, "--schemes", "lns,pre_ln", *alone, *steps(60)), 150),
        Benchmark("7b_width_2_layers", "layers7b", ("--config", wide, *alone, *steps(20), "--set", "model.num_layers=2"), 90),
        Benchmark("7b_width_4_layers", "layers7b", ("--config", wide, *alone, *steps(20), "--set", "model.num_layers=4"), 90),
    ]
    assert {spec.name for spec in specs} == set(BENCHMARKS)
    return specs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma-separated stages of {', '.join(STAGES)}")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_results",
                        help="directory for gpu_check.json, gpu_check.md and gpu_check.log (default: $OUT, "
                             "else gpu_check_results/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU with tiny shapes and the GPU tests' CPU mode: proves the plumbing, "
                             "measures nothing about a GPU")
    parser.add_argument("--time-limit-s", type=float, default=540.0,
                        help="start no item that cannot finish within this many seconds of the start (default 540)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="merge these gpu_check.json files (several calls' stages) and write the summary only")
    parser.add_argument("--print-environment", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def collect_environment() -> dict[str, Any]:
    """What the figures depend on: the GPU, torch, CUDA, DeepSpeed, transformers, apex, the fused kernels."""
    import torch

    from lnstrain.benchmark.hf_baseline import transformers_version
    from lnstrain.benchmark.peak import resolve_peak
    from lnstrain.model.norms import TORCH_FUSED_RMS_NORM_ON_CUDA, fused_rms_norm_affine

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "transformers": transformers_version(),
                           "apex": fused_rms_norm_affine is not None,
                           "torch_fused_rms_norm_on_cuda": TORCH_FUSED_RMS_NORM_ON_CUDA, "device_name": None}
    try:
        import deepspeed
        env["deepspeed"] = deepspeed.__version__
    except Exception as error:  # noqa: BLE001  (a broken install is worth recording, not fatal here)
        env["deepspeed"] = None
        env["deepspeed_error"] = f"{type(error).__name__}: {error}"
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                   cudnn=torch.backends.cudnn.version(), flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                   cudnn_sdp_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
                   peak_bf16_tflops=resolve_peak(props.name, None).tflops)
        try:
            query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                               capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            env["nvidia_smi"] = f"unavailable: {error}"
    return env


class Check:
    """One call of the check: the document, the output directory, the log and the clock."""

    def __init__(self, out: Path, dry_run: bool, time_limit_s: float, stages: list[str]) -> None:
        self.out = out
        self.dry_run = dry_run
        self.deadline = time.monotonic() + time_limit_s
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        out.mkdir(parents=True, exist_ok=True)
        self.log: TextIO = open(out / "gpu_check.log", "a", encoding="utf-8")
        self.doc: dict[str, Any] = {"schema": SCHEMA, "dry_run": dry_run, "stages_requested": stages, "stages": {},
                                    "environment": None, "tests": None, "benchmarks": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if dry_run:
            self.env["LNSTRAIN_GPU_TESTS_DEVICE"] = "cpu"

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Rewrite gpu_check.json and gpu_check.md (atomically) with everything so far."""
        self.doc["summary"] = summary_json(self.doc)
        for name, text in (("gpu_check.json", json.dumps(self.doc, indent=1) + "\n"),
                           ("gpu_check.md", to_markdown(self.doc))):
            temporary = self.out / f".{name}.tmp"
            temporary.write_text(text, encoding="utf-8")
            os.replace(temporary, self.out / name)

    def run(self, command: list[str], timeout_s: float) -> tuple[int, float, str]:
        """Run ``command`` from the repository root, its output streamed to the terminal and the log;
        (exit code, seconds, the last lines). Past ``timeout_s`` its process group is killed (exit 124)."""
        self.say(f"$ {shlex.join(command)}")
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, errors="replace", start_new_session=True)
        tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)

        def pump() -> None:
            for line in process.stdout:
                tail.append(line.rstrip("\n"))
                self.say(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the child's own session: it and whatever it started
            process.wait()
            code = 124
            tail.append(f"killed after {timeout_s:.0f} s (--time-limit-s)")
        reader.join(timeout=10)
        return code, time.monotonic() - started, "\n".join(tail)

    def record_environment(self) -> None:
        code, _, output = self.run([sys.executable, str(Path(__file__).resolve()), "--print-environment"],
                                   min(self.remaining(), 120))
        try:
            self.doc["environment"] = json.loads(output.strip().splitlines()[-1]) if code == 0 else None
        except (json.JSONDecodeError, IndexError):
            self.doc["environment"] = None
        if self.doc["environment"] is None:
            self.doc["environment"] = {"error": f"environment probe failed (exit {code}): {output[-500:]}"}
        self.save()

    def run_tests(self) -> None:
        junit = self.scratch / "junit.xml"
        target = DRY_RUN_TESTS if self.dry_run else "tests/gpu"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", target,
                   f"--junitxml={junit}", "--durations=10"]
        code, seconds, tail = self.run(command, self.remaining())
        counts, failures = parse_junit(junit) if junit.is_file() else ({}, [])
        self.doc["tests"] = {"command": shlex.join(["python", *command[1:-2]]), "exit_code": code, "duration_s": seconds,
                             "counts": counts, "failures": failures,
                             "device": "cpu (LNSTRAIN_GPU_TESTS_DEVICE=cpu)" if self.dry_run else "cuda",
                             "output_tail": tail if code else ""}

    def run_benchmark(self, spec: Benchmark) -> None:
        report_path = self.scratch / f"{spec.name}.json"
        device = ("--device", "cpu", "--threads", "1", "--peak-tflops", "1.0") if self.dry_run else ("--device", "cuda")
        command = [sys.executable, "tools/benchmark.py", *spec.args, *device, "--json", str(report_path)]
        code, seconds, tail = self.run(command, self.remaining())
        report = json.loads(report_path.read_text()) if code == 0 and report_path.is_file() else None
        self.doc["benchmarks"][spec.name] = {
            "what": BENCHMARKS[spec.name], "command": shlex.join(["python", *command[1:-2]]),
            "exit_code": code if report is not None or code else 1, "duration_s": seconds, "report": report,
            "output_tail": "" if report is not None else tail}

    def stage(self, name: str) -> None:
        started = time.monotonic()
        items = [None] if name == "tests" else [b for b in benchmarks(self.dry_run) if b.stage == name]
        skipped = []
        for item in items:
            needed = 0.0 if self.dry_run else (300.0 if item is None else item.min_seconds)
            label = "tests" if item is None else item.name
            if self.remaining() < needed:
                skipped.append(label)
                self.say(f"== {label}: not started, {self.remaining():.0f} s left of --time-limit-s")
                continue
            self.say(f"== {label} ({self.remaining():.0f} s left)")
            if item is None:
                self.run_tests()
            else:
                self.run_benchmark(item)
            self.save()
        note = f"not started for lack of time: {', '.join(skipped)} (run --only {name} again)" if skipped else ""
        self.doc["stages"][name] = {"status": "incomplete" if skipped else "done",
                                    "duration_s": time.monotonic() - started, "note": note}
        self.save()


def parse_junit(path: Path) -> tuple[dict[str, int], list[dict[str, str]]]:
    """Counts (passed, failed, errors, skipped) and the failing tests with their messages."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in suites:
        for key, attribute in (("tests", "tests"), ("failed", "failures"), ("errors", "errors"), ("skipped", "skipped")):
            counts[key] += int(suite.get(attribute, 0))
        for case in suite.iter("testcase"):
            for outcome in case:
                if outcome.tag in ("failure", "error"):
                    failures.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": outcome.tag,
                                     "message": (outcome.get("message") or "")[:500]})
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts, failures


def summarize_files(paths: list[str], out: Path) -> int:
    documents = []
    for path in paths:
        try:
            documents.append(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as error:
            print(f"gpu_check: cannot read {path}: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
    try:
        merged = merge_documents(documents)
    except ValueError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    merged["summary"] = summary_json(merged)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    markdown = to_markdown(merged)
    (out / "gpu_check.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_environment:
        print(json.dumps(collect_environment()))
        return 0
    if args.summarize:
        return summarize_files(args.summarize, Path(args.out))
    stages = [stage.strip() for stage in args.only.split(",") if stage.strip()]
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown or not stages:
        print(f"gpu_check: unknown stage(s) {unknown} in --only; choose from {', '.join(STAGES)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    check = Check(Path(args.out), args.dry_run, args.time_limit_s, stages)
    check.say(f"== gpu_check {'(dry run on the CPU) ' if args.dry_run else ''}stages {', '.join(stages)} -> {check.out}")
    check.record_environment()
    for line in json.dumps(check.doc["environment"], indent=1).splitlines():
        check.say(line)
    try:
        for stage in STAGES:  # always in the documented order
            if stage in stages:
                check.stage(stage)
    finally:
        shutil.rmtree(check.scratch, ignore_errors=True)
    check.say(to_markdown(check.doc))
    check.log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
