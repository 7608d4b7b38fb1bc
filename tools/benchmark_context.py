#!/usr/bin/env python
"""Activation memory per rank at context 1, 2 and 4 for one long sequence, measured on the CPU against
the --dry-run estimate: context parallelism should divide it by the context size.

Each point runs its context size as that many gloo ranks (lnstrain.benchmark.context_memory): one
micro-batch's forward and loss on each rank's chunks of a sequence of --seq-len tokens, the bytes
alive after it (kept for backward) on the most loaded rank, next to the estimate's activations for
the same config (estimate.memory, device cpu). fp32, no recomputation, tensor and pipeline 1.

    python tools/benchmark_context.py                      # 60M LNS, 4 layers, 8192 tokens: docs/performance.md
    python tools/benchmark_context.py --seq-len 16384 --methods ring

Exit status: 0 when every point's estimate is within --tolerance of its measurement, 1 when one is
not, 2 for a bad option or config.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.config.loader import ConfigError  # noqa: E402
from lnstrain.config.run_config import load_config  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", default="configs/60m_lns.yaml", help="the run description (default: 60M LNS)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4, to keep it quick)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens of the one sequence (default 8192)")
    parser.add_argument("--contexts", default="1,2,4", help="context sizes, comma-separated (default 1,2,4)")
    parser.add_argument("--methods", default="ring,all_to_all",
                        help="parallel.context_method values for context > 1 (default ring,all_to_all)")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="largest accepted |estimate / measured - 1| (default 0.10)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config override")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        methods = [m for m in args.methods.split(",") if m]
        config = load_config(args.config, [f"model.num_layers={args.layers}", f"data.seq_len={args.seq_len}",
                                           f"model.max_seq_len={args.seq_len}", "train.micro_batch_size=1",
                                           "precision.dtype=fp32", "model.hidden_dropout=0.0", *args.set],
                             validate=False)
    except (ConfigError, ValueError, OSError) as error:
        print(f"benchmark_context: {error}", file=sys.stderr)
        return 2
    from lnstrain.benchmark.context_memory import measure_context_memory

    print(f"{args.config}, {args.layers} layers (hidden {config.model.hidden_size}, {config.model.num_heads} heads, "
          f"{config.model.kv_heads} KV heads, vocabulary {config.model.vocab_size}), one sequence of {args.seq_len} "
          "tokens, fp32, no recomputation")
    print("| context | method | tokens per rank | kept for backward (measured) | estimate | estimate / measured "
          "| measured / context 1 | forward peak | backward peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    base, worst = None, 0.0
    for context in contexts:
        for method in (["ring"] if context == 1 else methods):
            point = measure_context_memory(config, context, method)
            base = base or point.kept
            worst = max(worst, abs(point.ratio - 1))
            print(f"| {context} | {method if context > 1 else '-'} | {point.tokens_per_rank} | "
                  f"{point.kept / MIB:,.1f} MiB | {point.estimated / MIB:,.1f} MiB | {point.ratio:.3f} | "
                  f"{point.kept / base:.3f} | {point.forward_peak / MIB:,.1f} MiB | "
                  f"{point.backward_peak / MIB:,.1f} MiB |", flush=True)
    print(f"largest |estimate / measured - 1|: {worst:.3f} (tolerance {args.tolerance})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
