#!/usr/bin/env python
"""What the in-training depth statistics cost: step time with and without collection.

Trains a single-process model (forward, backward, AdamW step) and interleaves plain steps with
armed steps, so that machine noise hits both alike. An armed step does what the trainer's does:
hooks installed for the forward and backward, the parameter gradients read before the optimizer
step (``read_parameter_grads``; under ZeRO or bf16 in a real run that read is a collective per
parameter, which one process cannot show), the statistics collected after it. Prints the median
plain step, the median extra cost of an armed step (paired differences, as measured: a negative one
is noise larger than the cost), and the amortised overhead at a few intervals: extra / (interval x
plain step). Both wall-clock and process CPU time are measured; on a shared machine CPU time is the
steadier of the two.

    python tools/benchmark_depth_stats.py --preset 60m --num-layers 12 --seq-len 256 --batch-size 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads distort timings on a busy CPU
import torch  # noqa: E402

from lnstrain.analysis.depth_stats import DepthStatsCollector  # noqa: E402
from lnstrain.model import Transformer, model_preset  # noqa: E402
from lnstrain.parallel.groups import ParallelGroups  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402
from lnstrain.wording import counted  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="60m", help="model size preset (lnstrain/model/presets.py)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--ffn-hidden-size", type=int, default=352)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps per step")
    p.add_argument("--pairs", type=int, default=20, help="(plain, armed) step pairs to time")
    p.add_argument("--intervals", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--norm-scheme", default="lns")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_preset(args.preset, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       ffn_hidden_size=args.ffn_hidden_size, num_heads=args.num_heads,
                       vocab_size=args.vocab_size, max_seq_len=args.seq_len, norm_scheme=args.norm_scheme)
    device = torch.device(args.device)
    model = Transformer(cfg, ParallelGroups.single_process()).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    collector = DepthStatsCollector(model, ParallelGroups.single_process(), interval=1, num_layers=cfg.num_layers)
    windows = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)

    def step(armed: bool) -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        if armed:
            collector.arm()
        for chunk in windows.chunk(args.micro_batches):
            (model.loss(chunk[:, :-1], chunk[:, 1:]) / args.micro_batches).backward()
        if armed:  # the trainer's before_optimizer_step: gradients complete, not yet clipped
            collector.read_parameter_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if armed:
            collector.collect(step=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - cpu_start

    for _ in range(3):  # warm-up
        step(False), step(True)
    plain, armed = [], []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for is_armed in order:
            (armed if is_armed else plain).append(step(is_armed))
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_non_embedding_parameters / 1e6:.1f}M "
          f"non-embedding parameters; batch {args.batch_size} x {args.seq_len} tokens, "
          f"{counted(args.micro_batches, 'micro-batch', 'micro-batches')}, {device}, {torch.get_num_threads()} "
          f"threads, {args.pairs} step pairs")
    for clock, index in (("wall-clock", 0), ("CPU time", 1)):
        print(cost_line(clock, [p[index] for p in plain], [a[index] for a in armed], args.intervals))
    return 0


def cost_line(clock: str, plain: list[float], armed: list[float], intervals: list[int]) -> str:
    """The median plain step, the median paired extra cost of an armed one (as measured: a negative
    median is the machine's noise), and the overhead it amortises to at each interval."""
    t_plain = statistics.median(plain)
    # Paired differences cancel slow drifts of the machine's load better than two medians.
    extra = statistics.median(a - p for a, p in zip(armed, plain))
    overheads = ", ".join(f"interval {n}: {extra / (n * t_plain):.3%}" for n in intervals)
    noise = " (negative: the machine's noise is larger than the cost)" if extra < 0 else ""
    return (f"{clock}: plain step {t_plain * 1e3:.1f} ms, armed step {extra * 1e3:+.2f} ms ({extra / t_plain:+.1%}); "
            f"amortised overhead {overheads}{noise}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
