#!/usr/bin/env python
"""One fp32 single-process state dict from a checkpoint of any parallel layout.

    python tools/consolidate_checkpoint.py --checkpoint runs/lns/checkpoints --output lns.safetensors

Writes a safetensors file with the single-process Transformer's parameter names; its metadata holds
the resolved run config (key ``lnstrain_config``, YAML). fp32 master weights are used when the
checkpoint has them (ZeRO partitions), else the module's weights.

The checkpoint is verified first, and chosen, as a resume would (docs/checkpoints.md, "One verifier for
every reader"): a run or checkpoint directory gives its newest checkpoint that verifies; a refusal
(nothing verifies, a file that would run code) exits 2 and writes nothing. --allow-pickle,
--allow-unverified and --key are the opt-ins every reader of a checkpoint takes.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.command_line import open_checkpoint_from_command_line  # noqa: E402
from lnstrain.checkpoint.errors import CheckpointError  # noqa: E402
from lnstrain.checkpoint.consolidated_file import save_consolidated  # noqa: E402
from lnstrain.checkpoint.layouts import read_full_state  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        args, step_dir, config = open_checkpoint_from_command_line(__doc__, argv, "FILE.safetensors to write")
        state = read_full_state(step_dir, config, with_optimizer=False, allow_pickle=args.allow_pickle)
    except CheckpointError as error:  # nothing verifies, or a file would run code: nothing was written
        print(f"consolidate_checkpoint: {error}", file=sys.stderr)
        return 2
    save_consolidated(args.output, state.weights, config)
    count = sum(t.numel() for t in state.weights.values())
    print(f"wrote {len(state.weights)} tensors ({count:,} parameters, {state.weights_source}) of {step_dir} to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
