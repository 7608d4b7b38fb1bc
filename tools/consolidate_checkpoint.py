#!/usr/bin/env python
"""One fp32 single-process state dict from a checkpoint of any parallel layout.

    python tools/consolidate_checkpoint.py --checkpoint runs/lns/checkpoints --output lns.safetensors

Writes a safetensors file with the single-process Transformer's parameter names; its metadata holds
the resolved run config (key ``lnstrain_config``, YAML). fp32 master weights are used when the
checkpoint has them (ZeRO partitions), else the module's weights.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.consolidated_file import save_consolidated  # noqa: E402
from lnstrain.checkpoint.layouts import read_full_state, read_step_config, resolve_step_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir or global_step<N> dir")
    parser.add_argument("--output", required=True, help="FILE.safetensors to write")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="fully unpickle DeepSpeed files that need it (only for files you trust)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    step_dir = resolve_step_dir(args.checkpoint)
    config = read_step_config(step_dir)
    state = read_full_state(step_dir, config, with_optimizer=False, allow_pickle=args.allow_pickle)
    save_consolidated(args.output, state.weights, config)
    count = sum(t.numel() for t in state.weights.values())
    print(f"wrote {len(state.weights)} tensors ({count:,} parameters, {state.weights_source}) of {step_dir} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
