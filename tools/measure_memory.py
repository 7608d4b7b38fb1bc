#!/usr/bin/env python
"""Measure real training steps' memory over a matrix of layouts and set the --dry-run estimate beside it.

Every point builds the DeepSpeed engine on the CPU (one or two gloo ranks), takes three steps on
synthetic tokens under a live-tensor tracker and reports the peak of the last, steady step next to
the estimate for the CPU (lnstrain.estimate.memory). The points: fp32 and bf16 at ZeRO 0-3 on one
rank, selective and full checkpointing, and two ranks of data (ZeRO 1-3), tensor (with and without
sequence parallelism) and pipeline parallelism; for every config given.

    python tools/measure_memory.py                       # 60M, 130M, 350M LNS: the table in docs/performance.md
    python tools/measure_memory.py --config configs/60m_lns.yaml --only "pipeline"

Exit status: 0 when every point is within --tolerance of its measurement, 1 when one is not,
2 for a bad option or config.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.benchmark.memory_matrix import POINTS, markdown_table, measure_point  # noqa: E402
from lnstrain.config.loader import ConfigError  # noqa: E402
from lnstrain.config.run_config import load_config  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

DEFAULT_CONFIGS = ["configs/60m_lns.yaml", "configs/130m_lns.yaml", "configs/350m_lns.yaml"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", action="append", dest="configs", metavar="YAML",
                        help="a run description; repeat for several (default: 60m, 130m and 350m LNS)")
    parser.add_argument("--seq-len", type=int, default=256, help="sequence length of every point (default 256)")
    parser.add_argument("--micro-batch-size", type=int, default=2,
                        help="train.micro_batch_size of every point (default 2)")
    parser.add_argument("--only", metavar="TEXT", help="only the points whose layout or overrides contain TEXT")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="largest accepted |estimate / measured - 1| (default 0.10)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table to PATH")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = args.configs or DEFAULT_CONFIGS
    shape = [f"data.seq_len={args.seq_len}", f"model.max_seq_len={max(args.seq_len, 1)}",
             f"train.micro_batch_size={args.micro_batch_size}"]
    points = [point for point in POINTS if not args.only or args.only in f"{point.layout} {point.label()}"]
    problems = [] if points else [f"--only {args.only!r} matches no point"]
    if args.seq_len < 1 or args.micro_batch_size < 1:
        problems.append("--seq-len and --micro-batch-size must be >= 1")
    for path in configs:
        try:
            load_config(path, shape, validate=False)
        except (ConfigError, OSError) as error:
            problems.append(f"{path}: {error}")
    if problems:
        print("measure_memory: nothing was measured:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    results = []
    for path in configs:
        for point in points:
            result = measure_point(path, point, shape, threads=max(1, (os.cpu_count() or 1) // point.world_size))
            print(f"{path} {point.layout} {point.label()}: estimate {result.estimated / 2**30:.3f} GiB, "
                  f"measured {result.measured / 2**30:.3f} GiB, ratio {result.ratio:.3f}", flush=True)
            results.append(result)
    table = markdown_table(results)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")
    worst = max(results, key=lambda result: abs(result.ratio - 1))
    print(f"farthest from its measurement: {worst.point.layout} {worst.point.label()} ({worst.config}), "
          f"ratio {worst.ratio:.3f}")
    return 0 if abs(worst.ratio - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
