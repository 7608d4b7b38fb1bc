#!/usr/bin/env python
"""One fp32 single-process state dict from a checkpoint of any parallel layout.

    python tools/consolidate_checkpoint.py --checkpoint runs/lns/checkpoints --output lns.safetensors

Writes a safetensors file with the single-process Transformer's parameter names; its metadata holds
the resolved run config (key ``lnstrain_config``, YAML). fp32 master weights are used when the
checkpoint has them (ZeRO partitions), else the module's weights.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.command_line import open_checkpoint_from_command_line  # noqa: E402
from lnstrain.checkpoint.consolidated_file import save_consolidated  # noqa: E402
from lnstrain.checkpoint.layouts import read_full_state  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args, step_dir, config = open_checkpoint_from_command_line(__doc__, argv, "FILE.safetensors to write")
    state = read_full_state(step_dir, config, with_optimizer=False, allow_pickle=args.allow_pickle)
    save_consolidated(args.output, state.weights, config)
    count = sum(t.numel() for t in state.weights.values())
    print(f"wrote {len(state.weights)} tensors ({count:,} parameters, {state.weights_source}) of {step_dir} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
