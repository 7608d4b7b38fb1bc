#!/usr/bin/env python
"""Export an lnstrain checkpoint (any parallel layout) as a Hugging Face LLaMA checkpoint.

    python tools/convert_to_hf.py --checkpoint runs/lns/checkpoints --output hf/lns [--dtype bf16] [--shard-size 5GB]

--checkpoint takes a run directory, its checkpoints/ directory (newest complete step) or one
global_step<N>. For LayerNorm Scaling the 1/sqrt(l) factors are folded into the weights, so
transformers' LlamaForCausalLM computes the same logits; config.json records the fold (key
"lnstrain"), so that tools/convert_from_hf.py and checkpoint.init_from unfold it again, exactly.
Post-LN, DeepNorm, Mix-LN, Sandwich-LN, LayerScale and LayerNorm models are refused: plain LLaMA
code cannot compute them.

The checkpoint is verified first, and chosen, as a resume would (docs/checkpoints.md, "One verifier for
every reader"): a run or checkpoint directory gives its newest checkpoint that verifies; a refusal
(nothing verifies, a file that would run code) exits 2 and writes nothing. --allow-pickle,
--allow-unverified and --key are the opt-ins every reader of a checkpoint takes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.command_line import open_checkpoint_from_command_line  # noqa: E402
from lnstrain.checkpoint.errors import CheckpointError  # noqa: E402
from lnstrain.checkpoint.hf_io import save_hf_checkpoint  # noqa: E402
from lnstrain.checkpoint.hf_exportable import export_problems  # noqa: E402
from lnstrain.checkpoint.layouts import read_full_state  # noqa: E402


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="the weights' dtype (default: bf16, half of fp32's size: every weight is rounded to "
                             "bf16, so the logits differ from the trained model's by that rounding; fp32 "
                             "reproduces them, and is what continued pretraining from the export needs)")
    parser.add_argument("--shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")


def main(argv: list[str] | None = None) -> int:
    try:
        args, step_dir, config = open_checkpoint_from_command_line(
            __doc__, argv, "directory to write the Hugging Face checkpoint to", _add_export_arguments)
        problems = export_problems(config.model)
        if problems:
            print("cannot export " + str(step_dir) + ":\n  " + "\n  ".join(problems), file=sys.stderr)
            return 2
        state = read_full_state(step_dir, config, with_optimizer=False, allow_pickle=args.allow_pickle)
    except CheckpointError as error:  # nothing verifies, or a file would run code: nothing was written
        print(f"convert_to_hf: {error}", file=sys.stderr)
        return 2
    output = save_hf_checkpoint(state.weights, config.model, args.output, args.dtype, args.shard_size,
                                config.data.tokenizer or None)
    print(f"exported {step_dir} ({state.weights_source}, norm_scheme={config.model.norm_scheme.value}) "
          f"to {output} as {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
