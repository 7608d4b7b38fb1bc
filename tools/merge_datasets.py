#!/usr/bin/env python
"""Join several token files (<prefix>.bin/.idx, same dtype) into one, in the order given.

    python tools/merge_datasets.py --input data/part0 data/part1 --output-prefix data/all
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.data.indexed_writer import merge_datasets  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="prefixes to merge (without .bin/.idx)")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        merged = merge_datasets(args.input, args.output_prefix)
    except (OSError, ValueError) as e:
        print(f"merge_datasets: error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(args.input)} file(s) into {args.output_prefix}: {merged.num_documents} documents, "
          f"{merged.num_tokens} tokens ({merged.dtype}) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
