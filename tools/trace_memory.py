#!/usr/bin/env python
"""Trace a config's activation memory on fake tensors and set it beside the --dry-run estimate.

The model is built at one tensor rank and one pipeline stage in the training dtype, without
allocating anything (FakeTensorMode), and one micro-batch runs forward and backward with the
configured activation checkpointing. Printed: what one layer keeps for backward (measured and by
the estimate's formula), what the whole model keeps after the forward, and the forward's peak
against the estimate's activations. Seconds for any size on a CPU; no GPU needed.

    python tools/trace_memory.py --config configs/bench/1b_seq2048.yaml
    python tools/trace_memory.py --config configs/7b_lns.yaml --set train.activation_checkpointing=full --json t.json

Parallel layouts divide these figures by the formula (tensor and sequence parallelism, pipeline
stages); the dry run applies that division. Exit status 2: a bad config or option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.benchmark.activation_trace import trace_activations  # noqa: E402
from lnstrain.config.loader import ConfigError, add_override_argument  # noqa: E402
from lnstrain.config.run_config import load_config  # noqa: E402
from lnstrain.estimate.memory import GIB, element_bytes, layer_activation_bytes, memory_estimate  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="run description (YAML)")
    add_override_argument(parser, "train.activation_checkpointing=full")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return parser.parse_args(argv)


def estimate_of(config) -> dict[str, float]:
    """The estimate's figures at one tensor rank and one stage, as traced: what one layer keeps, what
    the forward keeps, and the forward's peak above the weights (the loss's transient included) with
    the CPU's kernels and CUDA's (which differ only where the fp32-logits loss reads fp16 logits on CUDA
    without a copy)."""
    model, s, b = config.model, config.data.seq_len, config.train.micro_batch_size
    mode, e = config.train.activation_checkpointing, element_bytes(config)
    single = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tensor=1, pipeline=1,
                                                                       sequence_parallel=False))
    by_device = {}
    for device in ("cpu", "cuda"):
        stage = memory_estimate(single, 1, device=device).stages[0]
        by_device[device] = stage.activations[mode] + stage.forward_transient
    return {"per_layer": layer_activation_bytes(model, s, b, 1, False, mode, element_bytes=e),
            "kept_after_forward": memory_estimate(single, 1, device="cpu").stages[0].activations[mode],
            "forward_peak_cpu": by_device["cpu"], "forward_peak_cuda": by_device["cuda"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides, validate=False)
        problems = config.model.validate(tensor_parallel=1)
    except ConfigError as error:
        problems = error.problems
    if problems:
        print(f"trace_memory: {len(problems)} problem(s) in {args.config}:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    trace = trace_activations(config)
    estimate = estimate_of(config)
    layers = trace.kept_per_layer
    typical = sorted(layers)[len(layers) // 2]
    mode = config.train.activation_checkpointing
    print(f"{config.run.name}: {config.model.num_layers} layers, micro-batch {config.train.micro_batch_size} × "
          f"sequence {config.data.seq_len}, {config.precision.dtype}, checkpointing {mode} (one tensor rank, one stage)")
    print(f"  weights:                    {trace.weights / GIB:8.2f} GiB")
    print(f"  kept per layer (median):    {typical / MIB:8.1f} MiB   estimate {estimate['per_layer'] / MIB:8.1f} MiB "
          f"(ratio {estimate['per_layer'] / typical:.3f})")
    print(f"  kept after the forward:     {trace.kept_after_forward / GIB:8.2f} GiB   estimate "
          f"{estimate['kept_after_forward'] / GIB:8.2f} GiB (ratio {estimate['kept_after_forward'] / trace.kept_after_forward:.3f})")
    print(f"  forward peak above weights: {trace.forward_peak / GIB:8.2f} GiB   estimate {estimate['forward_peak_cpu'] / GIB:8.2f}"
          f" GiB (ratio {estimate['forward_peak_cpu'] / trace.forward_peak:.3f})"
          + (f"; on CUDA: {estimate['forward_peak_cuda'] / GIB:.2f} GiB"
             if estimate["forward_peak_cuda"] != estimate["forward_peak_cpu"] else "; the same on CUDA"))
    print(f"  peak over forward+backward: {trace.peak / GIB:8.2f} GiB (gradients included)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": args.config, "overrides": args.overrides, "activation_checkpointing": mode,
                       "weights_bytes": trace.weights, "kept_per_layer_bytes": layers,
                       "kept_after_forward_bytes": trace.kept_after_forward, "forward_peak_bytes": trace.forward_peak,
                       "peak_bytes": trace.peak, "estimate": estimate}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
