#!/usr/bin/env python
"""Import a Hugging Face LLaMA checkpoint as lnstrain's single-process state dict (continued pretraining).

    python tools/convert_from_hf.py --hf hf/llama --config configs/my_run.yaml --output init.safetensors

The run config's model section must describe the same shape (the differences are listed otherwise).
Start a run from the result with ``checkpoint.init_from: init.safetensors`` (or name the Hugging Face
directory there directly). An lnstrain export of an LNS model records in its config.json that the
1/sqrt(l) factors are folded into the weights; they are then divided out again, exactly (the export
carries the gains as trained), and a line says so. Any other LLaMA loads as it is; into an LNS config
that changes the function, and a warning says so. --unfold-lns / --no-unfold-lns override the record.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.consolidated_file import save_consolidated  # noqa: E402
from lnstrain.checkpoint.hf_io import load_hf_llama_state_dict  # noqa: E402
from lnstrain.checkpoint.sharding import check_full_state_dict  # noqa: E402
from lnstrain.config.loader import add_override_argument  # noqa: E402
from lnstrain.config.run_config import load_config  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--hf", required=True, help="Hugging Face LLaMA directory (config.json + safetensors)")
    parser.add_argument("--config", required=True, help="the lnstrain run YAML whose model to fill")
    add_override_argument(parser)
    parser.add_argument("--output", required=True, help="FILE.safetensors to write")
    parser.add_argument("--unfold-lns", action=argparse.BooleanOptionalAction, default=None,
                        help="divide out the 1/sqrt(l) factors an lnstrain LNS export folded into the weights, or "
                             "(--no-unfold-lns) load the weights as they are (default: unfold exactly when "
                             "config.json records the fold, which lnstrain's exports do)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    config = load_config(args.config, args.overrides, validate=False)
    try:
        state = load_hf_llama_state_dict(args.hf, config.model, unfold_lns=args.unfold_lns)
        check_full_state_dict(state, config.model, args.hf)
    except ValueError as error:
        print(f"cannot import {args.hf}:\n{error}", file=sys.stderr)
        return 2
    save_consolidated(args.output, state, config)
    print(f"wrote {len(state)} tensors for {args.config}'s model to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
