"""The command line the checkpoint export tools share (``tools/consolidate_checkpoint.py``,
``tools/convert_to_hf.py``): ``--checkpoint``, ``--output``, the tool's own options, and the opt-ins
every reader of a checkpoint takes (``verifier.add_trust_arguments``: ``--allow-pickle``,
``--allow-unverified``, ``--key``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from lnstrain.checkpoint.layouts import read_step_config
from lnstrain.checkpoint.verifier import add_trust_arguments, open_checkpoint, trust_from_arguments
from lnstrain.config.run_config import Config
from lnstrain.help_formatter import HelpFormatter


def open_checkpoint_from_command_line(
        description: str, argv: Sequence[str] | None, output_help: str,
        add_tool_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[argparse.Namespace, Path, Config]:
    """Parse a tool's command line, set up console logging, and find the checkpoint it names: the
    one a resume would choose (``verifier.open_checkpoint``), verified in full.

    Returns (arguments, step directory, resolved run config); the weights are not read yet, so a
    tool can refuse a config first. ``args.allow_pickle`` is for ``read_full_state``. Raises
    ``CheckpointError`` when nothing there may be read (the tool prints it and exits 2).
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir or global_step<N> dir")
    parser.add_argument("--output", required=True, help=output_help)
    if add_tool_arguments is not None:
        add_tool_arguments(parser)
    add_trust_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    step_dir = open_checkpoint(args.checkpoint, trust_from_arguments(args, args.checkpoint))
    return args, step_dir, read_step_config(step_dir)
