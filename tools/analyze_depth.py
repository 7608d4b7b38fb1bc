#!/usr/bin/env python
"""Depth analysis of a trained model: is the Curse of Depth there, and does LNS lift it?

Measures, on validation tokens: the layer-wise output variance of the residual stream, the
angular distance between the states entering every pair of layers, and layer pruning (ΔP(l):
the validation loss/perplexity change, and optionally multiple-choice accuracy change, when
layer l alone is skipped). Writes JSON, CSV, a Markdown report and (with matplotlib) PNG plots.

    # one run (a checkpoint of any parallel layout, or a single-process state dict + its config)
    python tools/analyze_depth.py --checkpoint runs/lns/checkpoints --data data/valid --output out/lns
    python tools/analyze_depth.py --state-dict lns.pt --config configs/demo.yaml --data data/valid --output out/lns
    # a Hugging Face model as it is on disk (LLaMA, Mistral, Qwen2, Qwen3), through transformers,
    # on text tokenized by its own tokenizer
    python tools/analyze_depth.py --hf models/Llama-2-7b-hf --text valid.jsonl --dtype bf16 --device cuda \
        --output out/llama2
    # Pre-LN and LNS side by side, from finished analyses, checkpoints or Hugging Face directories
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.analysis.claims import REFERENCE_SCHEME, claims_console, evaluate_claims  # noqa: E402
from lnstrain.analysis.depth_analysis import DEFAULT_NEAR_IDENTITY_THRESHOLD, DepthAnalysis, analyze_model  # noqa: E402
from lnstrain.analysis.eval_data import text_batches, validation_batches  # noqa: E402
from lnstrain.analysis.model_source import DepthModel, LnstrainDepthModel  # noqa: E402
from lnstrain.analysis.report import read_analyses, write_report  # noqa: E402
from lnstrain.analysis.text_tokens import (  # noqa: E402
    DocumentTokenizer, SentencePieceDocuments, check_vocabularies_agree, load_data_tokenizer,
)
from lnstrain.checkpoint.verifier import add_trust_arguments, trust_from_arguments  # noqa: E402
from lnstrain.config.loader import add_override_argument  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

HF_DEFAULT_SEQ_LEN = 2048


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    source = p.add_argument_group("model (one run)")
    source.add_argument("--checkpoint", help="checkpoint directory of any parallel layout")
    source.add_argument("--state-dict", help="torch.save'd single-process state dict (with --config)")
    source.add_argument("--config", help="the run's YAML config (with --state-dict)")
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face model directory (model_type llama, "
                                                    "mistral, qwen2 or qwen3), read through transformers")
    add_override_argument(source, "model.norm_scheme=lns")
    add_trust_arguments(source)  # a checkpoint is verified first, as a resume would (docs/checkpoints.md)
    p.add_argument("--compare", nargs="+", metavar="RUN",
                   help="runs to put side by side: analysis folders/JSON files, checkpoints or Hugging Face "
                        "directories (these two need --data or --text); runs of the same norm scheme count as "
                        "seeds in the claim verdicts")
    p.add_argument("--names", nargs="+", help="display names of the runs (default: saved names, run.name, or "
                                              "a Hugging Face directory's name)")
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
                   help="near-identity layer: skipping it raises the validation loss by less than this (nats)")
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
    for flag in ("num_samples", "batch_size", "seq_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


@dataclass
class OpenedModel:
    """A model ready for analysis, with what its own files say about data and tokenizer."""

    model: DepthModel
    tokenizer_path: str | None = None
    """lnstrain: the sentencepiece model of the run (loaded only when text must be tokenized)."""
    hf_tokenizer: DocumentTokenizer | None = None
    default_data: str | None = None
    default_seq_len: int | None = None
    run_name: str | None = None
    is_hf: bool = False

    def own_tokenizer(self) -> DocumentTokenizer | None:
        if self.is_hf:
            return self.hf_tokenizer
        return SentencePieceDocuments(self.tokenizer_path) if self.tokenizer_path else None


def open_lnstrain(args: argparse.Namespace, **source: str | None) -> OpenedModel:
    from lnstrain.analysis.model_loading import load_for_analysis

    trust = trust_from_arguments(args, source.get("checkpoint")) if source.get("checkpoint") else None
    config, model = load_for_analysis(**source, overrides=args.overrides, device=args.device, trust=trust)
    kind = "checkpoint" if source.get("checkpoint") else "state dict"
    return OpenedModel(LnstrainDepthModel(model, source=f"lnstrain {kind}, fp32"),
                       tokenizer_path=args.tokenizer or config.data.tokenizer or None,
                       default_data=config.data.valid_sources[0].prefix if config.data.valid_sources else None,
                       default_seq_len=config.data.seq_len, run_name=config.run.name)


def open_hf(args: argparse.Namespace, path: str) -> OpenedModel:
    from lnstrain.analysis.hf_source import load_hf_model

    model = load_hf_model(path, dtype=args.dtype, device=args.device, device_map=args.device_map,
                          offload_folder=args.offload_folder)
    return OpenedModel(model, hf_tokenizer=model.tokenizer, default_seq_len=min(HF_DEFAULT_SEQ_LEN, model.max_seq_len),
                       run_name=model.name, is_hf=True)


def _needs_tokenizer(opened: OpenedModel, purpose: str) -> DocumentTokenizer:
    tokenizer = opened.own_tokenizer()
    if tokenizer is None:
        fix = ("its directory has no tokenizer that transformers can read" if opened.is_hf
               else "pass --tokenizer FILE.model (the config has no data.tokenizer)")
        raise ValueError(f"{opened.model.name}: {purpose} needs the model's own tokenizer: {fix}")
    return tokenizer


def check_data_vocabulary(args: argparse.Namespace, opened: OpenedModel, prefix: str) -> None:
    """--data for a model whose tokenizer may not be the one that made it: compare them when possible."""
    own = opened.own_tokenizer() if (opened.is_hf or args.data_tokenizer) else None
    if args.data_tokenizer and own is not None:
        check_vocabularies_agree(load_data_tokenizer(args.data_tokenizer), own, prefix)
    elif opened.is_hf and own is not None:
        raise ValueError(f"--data {prefix}: token files do not say which tokenizer made them, and "
                         f"{opened.model.name} is a Hugging Face model with its own: pass --data-tokenizer "
                         "(the sentencepiece .model or tokenizer directory that made them) to check that they "
                         "agree, or --text FILE.jsonl to tokenize text with the model's tokenizer")
    elif opened.is_hf:
        logging.getLogger(__name__).warning("%s has no tokenizer: --data %s is checked only against the vocabulary "
                                            "size", opened.model.name, prefix)


def analyze(args: argparse.Namespace, opened: OpenedModel, name: str | None) -> DepthAnalysis:
    model = opened.model
    seq_len = args.seq_len or opened.default_seq_len
    if seq_len > model.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} is longer than {model.name}'s context of {model.max_seq_len} tokens")
    if args.text:
        tokenizer = _needs_tokenizer(opened, "--text")
        batches = text_batches(args.text, tokenizer.document, seq_len, args.num_samples, args.batch_size,
                               model.vocab_size)
        origin = f"{args.text} ({tokenizer.description})"
    else:
        origin = args.data or opened.default_data
        if origin is None:
            raise ValueError("no validation data: pass --data PREFIX or --text FILE (the model has no "
                             "data.valid_sources)")
        check_data_vocabulary(args, opened, origin)
        batches = validation_batches(origin, seq_len, args.num_samples, args.batch_size, model.vocab_size)
    items = []
    if args.mc_task:
        from lnstrain.analysis.pruning import load_multiple_choice

        tokenizer = _needs_tokenizer(opened, "--mc-task")
        items = load_multiple_choice(args.mc_task, tokenizer.encode, context_prefix=tokenizer.question_prefix(),
                                     encode_choice=tokenizer.continuation)
    name = name or model.name
    print(f"{name}: {model.num_layers} layers ({model.source}), {len(batches)} batches of {seq_len} tokens "
          f"from {origin}")
    return analyze_model(model, batches, name=name, items=items, near_identity_threshold=args.threshold)


def load_run(args: argparse.Namespace, path: str, name: str | None) -> DepthAnalysis:
    from lnstrain.analysis.hf_source import is_hf_model_directory

    location = Path(path)
    if location.suffix == ".json" or (location / "depth_analysis.json").is_file():
        runs = read_analyses(location)
        if len(runs) != 1:
            raise ValueError(f"{path}: holds {len(runs)} runs; compare single-run analyses")
        run = runs[0]
        if name:
            run.name = name
        return run
    opened = open_hf(args, path) if is_hf_model_directory(location) else open_lnstrain(args, checkpoint=path)
    return analyze(args, opened, name or opened.run_name)


def analyze_runs(args: argparse.Namespace) -> list[DepthAnalysis]:
    if args.compare:
        names = args.names or [None] * len(args.compare)
        return [load_run(args, path, name) for path, name in zip(args.compare, names)]
    if args.hf:
        return [analyze(args, open_hf(args, args.hf), args.name)]
    return [analyze(args, open_lnstrain(args, checkpoint=args.checkpoint, state_dict=args.state_dict,
                                        config=args.config), args.name)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        runs = analyze_runs(args)
    except (ValueError, FileNotFoundError) as e:  # a CheckpointError (nothing verifies) is a ValueError
        print(f"analyze_depth: {e}", file=sys.stderr)
        return 2
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
