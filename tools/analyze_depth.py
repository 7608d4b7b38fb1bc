#!/usr/bin/env python
"""Depth analysis of a trained model: is the Curse of Depth there, and does LNS lift it?

Measures, on validation tokens: the layer-wise output variance of the residual stream, the
angular distance between the states entering every pair of layers, and layer pruning (ΔP(l):
the validation loss/perplexity change, and optionally multiple-choice accuracy change, when
layer l alone is skipped). Writes JSON, CSV, a Markdown report and (with matplotlib) PNG plots.

    # one run (a checkpoint of any parallel layout, or a single-process state dict + its config)
    python tools/analyze_depth.py --checkpoint runs/lns/checkpoints --data data/valid --output out/lns
    python tools/analyze_depth.py --state-dict lns.pt --config configs/demo.yaml --data data/valid --output out/lns
    # a Hugging Face model as it is on disk (the families of lnstrain/analysis/hf_families.py), through
    # transformers, on text tokenized by its own tokenizer (docs/analyze_open_models.md)
    python tools/analyze_depth.py --hf models/Llama-2-7b-hf --text valid.jsonl --dtype bf16 --device cuda \
        --output out/llama2
    # Pre-LN and LNS side by side, from finished analyses, checkpoints or Hugging Face directories
    python tools/analyze_depth.py --compare out/pre_ln out/lns --output out/compare
    # several seeds per scheme: --groups puts runs into configurations, whose runs are seeds
    python tools/analyze_depth.py --compare out/pre_ln_s1 out/pre_ln_s2 out/lns_s1 out/lns_s2 \
        --groups pre_ln pre_ln lns lns --output out/compare

Every entry is resolved and checked, and every model's windows cut, before any weight is read; all
problems are listed at once (exit 2). Runs measured on different windows are refused unless
--allow-different-windows. Every report carries the paper's claims with verdicts computed from the
runs (lnstrain/analysis/claims.py): a `claims` list in depth_analysis.json, a table in report.md,
and the same on the console.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.analysis.claims import REFERENCE_SCHEME, claims_console, evaluate_claims, unclaimed  # noqa: E402
from lnstrain.analysis.depth_analysis import (  # noqa: E402
    DEFAULT_NEAR_IDENTITY_THRESHOLD, DepthAnalysis, analyze_model, summarize,
)
from lnstrain.analysis.inputs import (  # noqa: E402
    HF_DEFAULT_SEQ_LEN, DataOptions, LoadOptions, PlannedRun, checkpoint_entry, hf_entry, plan_runs, resolve_entry,
    state_dict_entry,
)
from lnstrain.analysis.report import write_report  # noqa: E402
from lnstrain.checkpoint.verifier import add_trust_arguments, trust_from_arguments  # noqa: E402
from lnstrain.config.loader import add_override_argument  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    source = p.add_argument_group("model (one run)")
    source.add_argument("--checkpoint", help="checkpoint directory of any parallel layout")
    source.add_argument("--state-dict", help="torch.save'd single-process state dict (with --config)")
    source.add_argument("--config", help="the run's YAML config (with --state-dict)")
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face model directory of a supported family "
                                                    "(docs/analyze_open_models.md), read through transformers")
    add_override_argument(source, "model.norm_scheme=lns")
    add_trust_arguments(source)  # a checkpoint is verified first, as a resume would (docs/checkpoints.md)
    p.add_argument("--compare", nargs="+", metavar="RUN",
                   help="runs to put side by side: analysis folders/JSON files, checkpoints or Hugging Face "
                        "directories (these two need --data or --text); each run is its own configuration in the "
                        "claim verdicts unless --groups says otherwise")
    p.add_argument("--names", nargs="+", help="display names of the runs (default: saved names, run.name, or "
                                              "a Hugging Face directory's name)")
    p.add_argument("--groups", nargs="+", metavar="LABEL",
                   help="one configuration label per --compare run: runs with the same label are seeds of one "
                        "configuration in the claim verdicts (they must share a norm scheme)")
    p.add_argument("--allow-different-windows", action="store_true",
                   help="compare runs measured on different windows (length, count, text or tokenizer); the "
                        "report says how they differ")
    p.add_argument("--name", help="display name of the single run (default: its norm scheme, or a Hugging Face "
                                  "directory's name)")
    data = p.add_argument_group("validation data")
    data.add_argument("--data", help="validation token-file prefix (<prefix>.bin/.idx); "
                                     "default: the config's first data.valid_sources")
    data.add_argument("--data-tokenizer", metavar="TOKENIZER",
                      help="the tokenizer --data was made with (sentencepiece .model or Hugging Face tokenizer "
                           "directory): checked to be the model's own; needed with --data for a Hugging Face "
                           "model that has a tokenizer")
    data.add_argument("--text", metavar="FILE",
                      help="validation text instead of --data (.jsonl with a 'text' key, .txt, or .gz/.zst of "
                           "them; a glob), tokenized by each model's own tokenizer")
    data.add_argument("--seq-len", type=int,
                      help=f"window length in tokens (default: the config's data.seq_len; Hugging Face: "
                           f"{HF_DEFAULT_SEQ_LEN} or the model's context if shorter)")
    data.add_argument("--num-samples", type=int, default=64, help="validation windows of seq_len + 1 tokens")
    data.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    data.add_argument("--mc-task", help="multiple-choice JSONL: {question, choices, answer} per line")
    data.add_argument("--tokenizer", help="sentencepiece .model of an lnstrain run, for --text and --mc-task "
                                          "(default: data.tokenizer); Hugging Face models use their own")
    hardware = p.add_argument_group("precision and placement")
    hardware.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, cuda:1, ...)")
    hardware.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                          help="Hugging Face models' weights and compute (default: fp32; bf16 halves the memory "
                               "of a large model); lnstrain checkpoints are analysed in fp32")
    hardware.add_argument("--device-map", metavar="MAP",
                          help="spread a Hugging Face model too large for one device over all visible ones: "
                               "transformers' device_map (auto, balanced, sequential); needs accelerate")
    hardware.add_argument("--offload-folder", metavar="DIR",
                          help="with --device-map: where weights that fit in no device's memory go (on disk)")
    p.add_argument("--threshold", type=float, default=DEFAULT_NEAR_IDENTITY_THRESHOLD,
                   help="near-identity layer: skipping it changes the validation loss by less than this, either way "
                        "(|ΔP|, nats)")
    p.add_argument("--output", required=True, help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = p.parse_args(argv)
    sources = [flag for flag, value in (("--checkpoint", args.checkpoint), ("--state-dict", args.state_dict),
                                        ("--hf", args.hf)) if value]
    if args.compare is None and not sources:
        p.error("give --checkpoint, --state-dict with --config, --hf DIR, or --compare RUN RUN")
    if len(sources) > 1 or (sources and args.compare):
        p.error(f"give one model: {', '.join(sources + (['--compare'] if args.compare else []))} were all given")
    if args.data and args.text:
        p.error("give --data or --text, not both")
    if args.data_tokenizer and not args.data:
        p.error("--data-tokenizer names the tokenizer of --data token files: give --data too")
    if args.offload_folder and not args.device_map:
        p.error("--offload-folder goes with --device-map")
    if args.hf and args.tokenizer:
        p.error("--tokenizer is for lnstrain runs: a Hugging Face model uses the tokenizer in its directory")
    if args.compare and args.names and len(args.names) != len(args.compare):
        p.error(f"--names has {len(args.names)} entries for {len(args.compare)} --compare runs")
    if args.groups and not args.compare:
        p.error("--groups labels --compare runs: give --compare too")
    if args.groups and len(args.groups) != len(args.compare):
        p.error(f"--groups has {len(args.groups)} labels for {len(args.compare)} --compare runs")
    for flag in ("num_samples", "batch_size", "seq_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def data_options(args: argparse.Namespace) -> DataOptions:
    return DataOptions(text=args.text, data=args.data, data_tokenizer=args.data_tokenizer, tokenizer=args.tokenizer,
                       seq_len=args.seq_len, num_samples=args.num_samples, batch_size=args.batch_size,
                       mc_task=args.mc_task)


def load_options(args: argparse.Namespace) -> LoadOptions:
    return LoadOptions(dtype=args.dtype, device=args.device, device_map=args.device_map,
                       offload_folder=args.offload_folder, overrides=tuple(args.overrides),
                       trust=trust_from_arguments(args, args.checkpoint))


def plan(args: argparse.Namespace) -> tuple[list[PlannedRun], list[str]]:
    """Every entry resolved, named, checked and its windows cut, with every problem; no weight read."""
    data, loading = data_options(args), load_options(args)
    if args.compare:
        entries = [partial(resolve_entry, path, data, loading) for path in args.compare]
        given, names = args.compare, args.names or [None] * len(args.compare)
    elif args.hf:
        entries, given, names = [partial(hf_entry, args.hf, loading)], [args.hf], [args.name]
    elif args.checkpoint:
        entries, given, names = [partial(checkpoint_entry, args.checkpoint, data, loading)], [args.checkpoint], [args.name]
    else:
        entries = [partial(state_dict_entry, args.state_dict, args.config, data, loading)]
        given, names = [args.state_dict], [args.name]
    return plan_runs(entries, given, names, data, groups=args.groups,
                     allow_different_windows=args.allow_different_windows)


def analyze(planned: PlannedRun, threshold: float) -> DepthAnalysis:
    """A finished analysis (its summary at `threshold`), or the model loaded and analysed."""
    if planned.finished is not None:
        planned.finished.summary = summarize(planned.finished.pruning, threshold)
        return planned.finished
    model = planned.load()
    print(f"{planned.name}: {model.num_layers} layers ({model.source}, {model.norm_scheme}), "
          f"{planned.windows.record.describe()}")
    return analyze_model(model, planned.windows.batches, name=planned.name, items=planned.items,
                         near_identity_threshold=threshold, windows=planned.windows.record)


def run_line(run: DepthAnalysis) -> str:
    s = run.summary
    negative = (f", removing layer{'s' if len(s.negative_layers) > 1 else ''} "
                f"{', '.join(map(str, s.negative_layers))} lowers the loss" if s.negative_layers else "")
    return (f"{run.name} ({run.norm_scheme}): loss {run.baseline.loss:.4f}, {s.num_near_identity}/{run.num_layers} "
            f"near-identity layers (|ΔP| < {s.near_identity_threshold:g}){negative}, deepest half carries "
            f"{s.deep_half_share:.1%} of ΔP")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        planned, problems = plan(args)
    except ValueError as e:  # transformers missing, before any entry could be read
        problems = [str(e)]
    if len(problems) == 1:
        print(f"analyze_depth: nothing analysed: {problems[0]}", file=sys.stderr)
        return 2
    if problems:
        print(f"analyze_depth: {len(problems)} problems, nothing analysed:\n"
              + "\n".join(f"  - {problem}" for problem in problems), file=sys.stderr)
        return 2
    try:
        runs = [analyze(p, args.threshold) for p in planned]
    except (ValueError, FileNotFoundError) as e:
        print(f"analyze_depth: {e}", file=sys.stderr)
        return 2
    claims = evaluate_claims(runs, groups=args.groups)
    report = write_report(runs, args.output, plots=not args.no_plots, claims=claims, groups=args.groups)
    for run in runs:
        print(run_line(run))
    testable = [c for c in claims if c.holds is not None]
    if testable:
        print("the paper's claims, verdicts computed from these runs:")
        print(claims_console(testable))
    untestable = sorted({c.id for c in claims if c.holds is None})
    if untestable:
        print(f"not testable without a {REFERENCE_SCHEME} run: {', '.join(untestable)} (compare with --compare)")
    others = unclaimed(runs)
    if others:
        print(f"in no claim (the paper's claims are about Pre-LN and LNS): "
              f"{', '.join(f'{r.name} ({r.norm_scheme})' for r in others)}")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
