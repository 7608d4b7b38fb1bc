#!/usr/bin/env python
"""Depth analysis of a trained model: is the Curse of Depth there, and does LNS lift it?

Measures, on a validation token file: the layer-wise output variance of the residual stream, the
angular distance between the states entering every pair of layers, and layer pruning (ΔP(l):
the validation loss/perplexity change, and optionally multiple-choice accuracy change, when
layer l alone is skipped). Writes JSON, CSV, a Markdown report and (with matplotlib) PNG plots.

    # one run (a checkpoint of any parallel layout, or a single-process state dict + its config)
    python tools/analyze_depth.py --checkpoint runs/lns/checkpoints --data data/valid --output out/lns
    python tools/analyze_depth.py --state-dict lns.pt --config configs/demo.yaml --data data/valid --output out/lns
    # Pre-LN and LNS side by side, from two finished analyses (or two checkpoints, given --data)
    python tools/analyze_depth.py --compare out/pre_ln out/lns --output out/compare
    # several seeds per scheme: runs of one norm scheme are seeds in the claim verdicts
    python tools/analyze_depth.py --compare out/pre_ln_s1 out/pre_ln_s2 out/lns_s1 out/lns_s2 --output out/compare

Every report carries the paper's claims with verdicts computed from the runs (lnstrain/analysis/claims.py):
a `claims` list in depth_analysis.json, a table in report.md, and the same on the console.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.analysis.claims import REFERENCE_SCHEME, claims_console, evaluate_claims  # noqa: E402
from lnstrain.analysis.depth_analysis import DEFAULT_NEAR_IDENTITY_THRESHOLD, DepthAnalysis, analyze_model  # noqa: E402
from lnstrain.analysis.eval_data import validation_batches  # noqa: E402
from lnstrain.analysis.model_loading import load_for_analysis  # noqa: E402
from lnstrain.analysis.report import read_analyses, write_report  # noqa: E402
from lnstrain.config.loader import add_override_argument  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    source = p.add_argument_group("model (one run)")
    source.add_argument("--checkpoint", help="checkpoint directory of any parallel layout")
    source.add_argument("--state-dict", help="torch.save'd single-process state dict (with --config)")
    source.add_argument("--config", help="the run's YAML config (with --state-dict)")
    add_override_argument(source, "model.norm_scheme=lns")
    p.add_argument("--compare", nargs="+", metavar="RUN",
                   help="runs to put side by side: analysis folders/JSON files, or checkpoints (need --data); "
                        "runs of the same norm scheme count as seeds in the claim verdicts")
    p.add_argument("--names", nargs="+", help="display names of the runs (default: saved names, or run.name)")
    p.add_argument("--name", help="display name of the single run (default: its norm scheme)")
    data = p.add_argument_group("validation data")
    data.add_argument("--data", help="validation token-file prefix (<prefix>.bin/.idx); "
                                     "default: the config's first data.valid_sources")
    data.add_argument("--seq-len", type=int, help="default: the config's data.seq_len")
    data.add_argument("--num-samples", type=int, default=64, help="validation windows of seq_len + 1 tokens")
    data.add_argument("--batch-size", type=int, default=8)
    data.add_argument("--mc-task", help="multiple-choice JSONL: {question, choices, answer} per line")
    data.add_argument("--tokenizer", help="sentencepiece .model for --mc-task (default: data.tokenizer)")
    p.add_argument("--threshold", type=float, default=DEFAULT_NEAR_IDENTITY_THRESHOLD,
                   help="near-identity layer: skipping it raises the validation loss by less than this (nats)")
    p.add_argument("--output", required=True, help="output folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = p.parse_args(argv)
    if args.compare is None and not (args.checkpoint or args.state_dict):
        p.error("give --checkpoint, --state-dict with --config, or --compare RUN RUN")
    if args.compare and args.names and len(args.names) != len(args.compare):
        p.error(f"--names has {len(args.names)} entries for {len(args.compare)} --compare runs")
    return args


def analyze_one(args: argparse.Namespace, name: str | None, name_from_run: bool = False,
                **source: str | None) -> DepthAnalysis:
    config, model = load_for_analysis(**source, overrides=args.overrides, device=args.device)
    prefix = args.data or (config.data.valid_sources[0].prefix if config.data.valid_sources else None)
    if prefix is None:
        raise SystemExit("no validation data: pass --data PREFIX (the config has no data.valid_sources)")
    seq_len = args.seq_len or config.data.seq_len
    batches = validation_batches(prefix, seq_len, args.num_samples, args.batch_size, config.model.vocab_size)
    for batch in batches:
        batch.tokens, batch.labels, batch.loss_mask = (t.to(args.device) for t in
                                                       (batch.tokens, batch.labels, batch.loss_mask))
    items = []
    if args.mc_task:
        from lnstrain.analysis.pruning import load_multiple_choice
        from lnstrain.data.tokenizer import Tokenizer

        tokenizer_path = args.tokenizer or config.data.tokenizer
        if not tokenizer_path:
            raise SystemExit("--mc-task needs --tokenizer (the config has no data.tokenizer)")
        tokenizer = Tokenizer(tokenizer_path)
        separator = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
        items = load_multiple_choice(args.mc_task, tokenizer.encode, context_prefix=separator)
    scheme = config.model.norm_scheme
    name = name or (config.run.name if name_from_run else getattr(scheme, "value", str(scheme)))
    print(f"{name}: {config.model.num_layers} layers, {len(batches)} batches of {seq_len} tokens from {prefix}")
    return analyze_model(model, batches, name=name, items=items, near_identity_threshold=args.threshold)


def load_run(args: argparse.Namespace, path: str, name: str | None) -> DepthAnalysis:
    location = Path(path)
    if location.suffix == ".json" or (location / "depth_analysis.json").is_file():
        runs = read_analyses(location)
        if len(runs) != 1:
            raise SystemExit(f"{path}: holds {len(runs)} runs; compare single-run analyses")
        run = runs[0]
        if name:
            run.name = name
        return run
    return analyze_one(args, name, name_from_run=True, checkpoint=path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.compare:
        names = args.names or [None] * len(args.compare)
        runs = [load_run(args, path, name) for path, name in zip(args.compare, names)]
    else:
        runs = [analyze_one(args, args.name, checkpoint=args.checkpoint, state_dict=args.state_dict,
                            config=args.config)]
    duplicates = sorted({run.name for run in runs if [r.name for r in runs].count(run.name) > 1})
    if duplicates:
        print(f"analyze_depth: several runs are named {', '.join(duplicates)}; give each its own name with "
              f"--names (one per --compare run)", file=sys.stderr)
        return 2
    claims = evaluate_claims(runs)
    report = write_report(runs, args.output, plots=not args.no_plots, claims=claims)
    for run in runs:
        s = run.summary
        print(f"{run.name}: loss {run.baseline.loss:.4f}, {s.num_near_identity}/{run.num_layers} near-identity "
              f"layers (ΔP < {s.near_identity_threshold:g}), deepest half carries {s.deep_half_share:.1%} of ΔP")
    testable = [c for c in claims if c.holds is not None]
    if testable:
        print("the paper's claims, verdicts computed from these runs (runs of one scheme are seeds):")
        print(claims_console(testable))
    untestable = sorted({c.id for c in claims if c.holds is None})
    if untestable:
        print(f"not testable without a {REFERENCE_SCHEME} run: {', '.join(untestable)} (compare with --compare)")
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
