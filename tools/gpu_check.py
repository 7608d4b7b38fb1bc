#!/usr/bin/env python
"""The GPU check: one prepared call to a lent GPU, the decisive figures first, into one JSON document
and a short Markdown table (``lnstrain/benchmark/gpu_plan.py`` is the plan, ``gpu_summary.py`` the table).

    python tools/gpu_check.py --plan                    # the first call's items, seconds each, the total
    bash launch/gpu_check.sh                            # call 1 on the GPU machine (installs .whl/ first)
    bash launch/gpu_check.sh --call 2                   # the optional second call
    bash launch/gpu_check.sh --only 1b_eager,core_tests # chosen items
    python tools/gpu_check.py --dry-run --output /tmp/dry  # the CPU, tiny shapes: the plumbing, no GPU figure
    python tools/gpu_check.py --summarize call1/gpu_check.json call2/gpu_check.json --output results/

Every item is a subprocess (a crash or an out-of-memory loses that item only) stopped at its seconds;
the items share one inductor and Triton cache (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR: --cache-dir, by
default .gpu_check_cache/ in the repository, which stays on a warm device machine between calls), so a
graph or kernel compiled by one item is not compiled again by the next, nor by the next call;
an item starts only if its seconds fit in what is left of the call (--time-limit-s, counted from
--started-at, which launch/gpu_check.sh sets before it installs the wheels); a benchmark needs 85 % of
them (``gpu_plan.BENCHMARK_START_SHARE``) and then times fewer steps. A benchmark item's figures
are its JSON report's: one that was written whole counts even when the process was stopped or failed
afterwards (in its teardown), and the item says so. The results (gpu_check.json, gpu_check.md) and
the whole output (gpu_check.log) are rewritten in --output after every item, so a call cut short keeps
what it finished.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lnstrain.benchmark.gpu_plan import (CALL_LIMIT_S, CALLS, CONFIG_1B, CONFIG_7B_WIDTH, CONFIG_TINY,  # noqa: E402
                                         ITEMS, PLAN, Item, call_items, plan_text)
from lnstrain.benchmark.gpu_summary import SCHEMA, merge_documents, summary_json, to_markdown  # noqa: E402
from lnstrain.benchmark.report import is_complete  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

EXIT_BAD_INPUT = 2
CONFIG_TINY_WIDE = "configs/bench/tiny_wide.yaml"  # the dry run's 7B-width pair: layers dominate its step
DRY_RUN_TESTS = "tests/gpu/test_kernels_on_device.py"
OUTPUT_TAIL_LINES = 40
BENCHMARK_TOOL = "tools/benchmark.py"
BENCHMARK_MARGIN_S = 8.0
"""Seconds of an item's allowance kept back from ``tools/benchmark.py --time-limit-s`` (which counts from the
process's start) for a last round slower than the one before, the report and the exit."""
CACHE_DIR = ".gpu_check_cache"
"""The items' shared inductor and Triton caches, in the repository (git-ignored)."""
ENGINE_STEP = ("--config", CONFIG_TINY, "--baseline", "none", "--set", "precision.dtype=bf16", "--set",
               "parallel.zero_stage=1", "--set", "train.compile=false", "--warmup", "0", "--steps", "1")
"""The environment item's one bf16 engine step in the training layout's optimizer (BF16_Optimizer), on
the tiny model: seconds, whatever the GPU."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--call", type=int, default=1, choices=CALLS, help="which call of the plan (default 1)")
    parser.add_argument("--only", default=None, help=f"comma-separated items instead of the call's: {', '.join(ITEMS)}")
    parser.add_argument("--plan", action="store_true", help="print the call's items and seconds, and exit")
    parser.add_argument("--output", default=os.environ.get("OUT") or "gpu_check_results",
                        help="directory for gpu_check.json, gpu_check.md and gpu_check.log (default: $OUT, "
                             "else gpu_check_results/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU with tiny shapes and the GPU tests' CPU mode: proves the plumbing, "
                             "measures nothing about a GPU (no item is held to its seconds)")
    parser.add_argument("--time-limit-s", type=float, default=CALL_LIMIT_S,
                        help=f"the call's seconds, from --started-at (default {CALL_LIMIT_S})")
    parser.add_argument("--started-at", type=float, default=None,
                        help="when the call began (seconds since the epoch; launch/gpu_check.sh passes the time "
                             "before its install); default now")
    parser.add_argument("--cache-dir", default=None,
                        help="the inductor and Triton caches every item shares (default: .gpu_check_cache/ in the "
                             "repository; a dry run: its scratch directory)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON",
                        help="merge these gpu_check.json files (several calls) and write the summary only")
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
                           "torch_fused_rms_norm_on_cuda": TORCH_FUSED_RMS_NORM_ON_CUDA, "device_name": None,
                           "cpu_count": os.cpu_count()}
    try:
        import deepspeed
        env["deepspeed"] = deepspeed.__version__
        env["deepspeed_path"] = str(Path(deepspeed.__file__).parent)
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


def dry_run_args(item: Item) -> tuple[str, ...]:
    """The item's arguments on the CPU: tiny shapes, few steps, the GPU tests' CPU mode, no kernel generation."""
    if item.kind == "tests":
        return ("-m", "gpu and gpu_core", DRY_RUN_TESTS)
    swap = {CONFIG_1B: CONFIG_TINY, CONFIG_7B_WIDTH: CONFIG_TINY_WIDE,
            "train.micro_batch_size=8": "train.micro_batch_size=4"}  # the tiny config's global batch is 4
    args = [swap.get(arg, arg) for arg in item.args]
    for flag, value in (("--steps", "3"), ("--warmup", "2")):
        if flag in args:
            args[args.index(flag) + 1] = value
    if "train.compile=true" in args:
        args += ["--set", "train.compile_backend=aot_eager"]  # traces as inductor would, generates no C++
    return tuple(args)


class Check:
    """One call of the check: the document, the output directory, the log and the clock."""

    def __init__(self, out: Path, dry_run: bool, deadline: float, calls: list[int], cache_dir: Path | None = None) -> None:
        self.out = out
        self.dry_run = dry_run
        self.deadline = deadline
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        out.mkdir(parents=True, exist_ok=True)
        self.log: TextIO = open(out / "gpu_check.log", "a", encoding="utf-8")
        self.doc: dict[str, Any] = {"schema": SCHEMA, "dry_run": dry_run, "calls": calls,
                                    "limit_s": None, "environment": None, "items": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        cache = cache_dir or (self.scratch / "cache" if dry_run else ROOT / CACHE_DIR)
        for variable, folder in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            self.env.setdefault(variable, str(cache / folder))
        if dry_run:
            self.env["LNSTRAIN_GPU_TESTS_DEVICE"] = "cpu"
        self.engine_failed: str | None = None

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def remaining(self) -> float:
        return self.deadline - time.time()

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
            code = 124
            tail.append(f"killed after {timeout_s:.0f} s (its allowance)")
        kill_session(process.pid)  # it, or what it left behind (compile workers hold the output pipe)
        process.wait()
        reader.join(timeout=10)
        return code, time.monotonic() - started, "\n".join(tail)

    def device_args(self) -> tuple[str, ...]:
        return ("--device", "cpu", "--threads", "1", "--peak-tflops", "1.0") if self.dry_run else ("--device", "cuda")

    def run_environment(self, item: Item, record: dict[str, Any], started_at: float) -> None:
        code, _, output = self.run([sys.executable, str(Path(__file__).resolve()), "--print-environment"],
                                   min(self.remaining(), 60))
        try:
            environment = json.loads(output.strip().splitlines()[-1]) if code == 0 else None
        except (json.JSONDecodeError, IndexError):
            environment = None
        self.doc["environment"] = environment or {"error": f"environment probe failed (exit {code}): {output[-500:]}"}
        for line in json.dumps(self.doc["environment"], indent=1).splitlines():
            self.say(line)
        install_end = os.environ.get("LNSTRAIN_WHEEL_INSTALL_END")
        record["install"] = {"status": os.environ.get("LNSTRAIN_WHEEL_INSTALL", "not run (DeepSpeed was importable)"),
                             "seconds": float(install_end) - started_at if install_end else None}
        report_path = self.scratch / "engine_step.json"
        command = [sys.executable, BENCHMARK_TOOL, *ENGINE_STEP, *self.device_args(), "--json", str(report_path)]
        allowance = max(min(self.remaining(), item.seconds), 1.0)
        code, seconds, tail = self.run(command, allowance)
        record["command"] = shlex.join(["python", *command[1:-2]])
        report = read_report(report_path)
        if report is not None:
            record["note"] = after_report_note(code, allowance)
            record["engine_step"] = {"device": report["environment"]["device_name"],
                                     "device_type": report["environment"]["device_type"], "seconds": seconds,
                                     "loss": report["runners"][0]["last_loss"],
                                     "triton_kernels": report.get("triton_kernels")}
        else:
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), f"exit {code}")
            record["engine_step"] = {"error": last, "exit_code": code}
            self.engine_failed = f"the environment item's bf16 engine step failed ({last[:200]})"
            record["output_tail"] = tail
        record["exit_code"] = code
        record["status"] = "done" if report is not None and not (environment or {}).get("error") else "failed"
        record["duration_s"] = time.time() - started_at  # the install before this process included

    def run_tests(self, item: Item, record: dict[str, Any]) -> None:
        junit = self.scratch / f"{item.name}.xml"
        args = dry_run_args(item) if self.dry_run else item.args
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, f"--junitxml={junit}",
                   "--durations=10"]
        code, seconds, tail = self.run(command, self.allowance(item))
        counts, failures = parse_junit(junit) if junit.is_file() else ({}, [])
        record.update(command=shlex.join(["python", *command[1:-2]]), exit_code=code, duration_s=seconds,
                      tests={"counts": counts, "failures": failures,
                             "device": "cpu (LNSTRAIN_GPU_TESTS_DEVICE=cpu)" if self.dry_run else "cuda"},
                      status="done" if code == 0 else "failed", output_tail=tail if code else "")

    def run_benchmark(self, item: Item, record: dict[str, Any]) -> None:
        report_path = self.scratch / f"{item.name}.json"
        allowance = self.allowance(item)
        args = dry_run_args(item) if self.dry_run else item.args
        command = [sys.executable, BENCHMARK_TOOL, *args, *self.device_args(),
                   "--time-limit-s", f"{max(allowance - BENCHMARK_MARGIN_S, 1.0):.0f}", "--json", str(report_path)]
        code, seconds, tail = self.run(command, allowance)
        report = read_report(report_path)
        early_profile = read_profile(report_path.with_name(f"{report_path.stem}.profile.json"))
        if early_profile is not None:  # written before timing: kept whatever became of the rest
            record["profile"] = early_profile
        record.update(command=shlex.join(["python", *command[1:-2]]), exit_code=code if report is not None or code else 1,
                      duration_s=seconds, report=report, status="done" if report is not None else "failed",
                      note=after_report_note(code, allowance) if report is not None else "",
                      output_tail="" if report is not None and code == 0 else tail)

    def allowance(self, item: Item) -> float:
        """The seconds ``item`` may run: its own, or on the CPU's dry run whatever is left of the call."""
        return self.remaining() if self.dry_run else min(item.seconds, self.remaining())

    def run_item(self, item: Item, started_at: float) -> None:
        record: dict[str, Any] = {"status": "not started", "allowed_s": item.seconds, "what": item.what,
                                  "issue_item": item.issue_item, "duration_s": 0.0, "note": ""}
        self.doc["items"][item.name] = record
        left = self.remaining()
        if item.needs_engine and self.engine_failed:
            record.update(status="skipped", note=self.engine_failed)
        elif (not self.dry_run and item.least_seconds > left) or left <= 0:
            record["note"] = (f"{item.least_seconds} s needed, {max(left, 0):.0f} s left "
                              f"(run it with --only {item.name})")
        else:
            self.say(f"== {item.name} ({item.seconds} s allowed, {left:.0f} s left of the call)")
            {"environment": lambda: self.run_environment(item, record, started_at),
             "tests": lambda: self.run_tests(item, record),
             "benchmark": lambda: self.run_benchmark(item, record)}[item.kind]()
        if record["status"] in ("not started", "skipped"):
            self.say(f"== {item.name}: {record['status']}: {record['note']}")
        self.save()


def kill_session(pid: int) -> None:
    """Kill every process of the session that ``pid`` leads (started with ``start_new_session``), if any is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_report(path: Path) -> dict[str, Any] | None:
    """The benchmark's JSON report at ``path`` if it is there and whole (``is_complete``), else None."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if is_complete(report) else None


def read_profile(path: Path) -> dict[str, Any] | None:
    """The profile a benchmark wrote before timing (``<report>.profile.json``), if it is there and whole."""
    try:
        early = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return early.get("profile") if isinstance(early, dict) else None


def after_report_note(code: int, allowance_s: float) -> str:
    """What became of a process after it wrote a whole report: nothing to say when it exited cleanly."""
    if code == 0:
        return ""
    what = (f"killed at its allowance ({allowance_s:.0f} s)" if code == 124 else f"exited with status {code}")
    return f"{what} after writing its whole report, i.e. during teardown: the figures are the report's"


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


def selected_items(args: argparse.Namespace) -> list[Item] | str:
    """The items to run, in plan order, or the problem with --only."""
    if args.only is None:
        return call_items(args.call)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in ITEMS]
    if unknown or not names:
        return f"unknown item(s) {unknown} in --only; choose from {', '.join(ITEMS)}"
    return [item for item in PLAN if item.name in names]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_environment:
        print(json.dumps(collect_environment()))
        return 0
    if args.summarize:
        return summarize_files(args.summarize, Path(args.output))
    if args.plan:
        print(plan_text(args.call, args.time_limit_s))
        return 0
    items = selected_items(args)
    if isinstance(items, str):
        print(f"gpu_check: {items}", file=sys.stderr)
        return EXIT_BAD_INPUT
    started_at = args.started_at or time.time()
    calls = sorted({item.call for item in items})
    check = Check(Path(args.output), args.dry_run, started_at + args.time_limit_s, calls,
                  Path(args.cache_dir) if args.cache_dir else None)
    check.doc["limit_s"] = args.time_limit_s
    check.say(f"== gpu_check {'(dry run on the CPU) ' if args.dry_run else ''}items {', '.join(i.name for i in items)} "
              f"-> {check.out}; {check.remaining():.0f} s left of {args.time_limit_s:g} s")
    try:
        for item in items:
            check.run_item(item, started_at)
    finally:
        shutil.rmtree(check.scratch, ignore_errors=True)
    check.say(to_markdown(check.doc))
    check.log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
