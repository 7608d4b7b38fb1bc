#!/usr/bin/env python
"""Tokenize a raw corpus into Megatron-format token files (<prefix>.bin + <prefix>.idx).

    python tools/preprocess_data.py --input corpus/*.jsonl.zst --tokenizer tok/spm.model \\
        --output-prefix data/c4_train --workers 16

Inputs: files or globs of .jsonl/.json/.txt, optionally .gz or .zst (needs `pip install zstandard`),
.parquet, and directories written by Hugging Face datasets' save_to_disk (these two need
`pip install pyarrow`). One document per JSON record or table row (or per text line, see --txt-mode);
EOS appended to each document. Streams with constant memory; outputs are written under a temporary
name and renamed when complete. Bad input exits 2 with one message naming the file.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.data.corpus_readers import TXT_MODES, expand_inputs  # noqa: E402
from lnstrain.data.preprocess import PreprocessConfig, PreprocessStats, preprocess  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a scheduler or container may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="input files, glob patterns, or datasets save_to_disk directories")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="the JSON key(s), or Parquet/Arrow column(s), holding the text (Megatron-LM's name; "
                        "tools/train_tokenizer.py takes the same); with several, one output <prefix>_<key> per key")
    p.add_argument("--txt-mode", choices=TXT_MODES, default="line",
                   help="what a document is in .txt files: a line, a blank-line-separated block, or the file")
    p.add_argument("--workers", type=int, default=max(1, available_cores() - 1), metavar="N",
                   help="processes that decode and tokenize while the main process reads and writes (default: "
                        "the cores available less one, at least 1; %(default)s here); more than the cores "
                        "available only adds overhead, so a larger N is capped at the core count, with a note")
    p.add_argument("--no-append-eos", dest="append_eos", action="store_false", help="do not append EOS")
    p.add_argument("--prepend-bos", action="store_true", help="prepend BOS to each document")
    p.add_argument("--batch-mb", type=float, default=1.0, help="raw MB per worker task")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    return p.parse_args(argv)


class Progress:
    """The live progress line on stderr (rewritten in place about once a second)."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, stats: PreprocessStats) -> None:
        self.shown = True
        print(f"\r{stats.seconds:7.0f}s  {stats.rates()}   ", end="", file=sys.stderr, flush=True)

    def end_line(self) -> str:
        return "\n" if self.shown else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        print(f"preprocess_data: error: --workers must be at least 1 (got {args.workers})", file=sys.stderr)
        return 2
    cores = available_cores()
    if args.workers > cores:
        print(f"preprocess_data: --workers {args.workers} is more than the {cores} core(s) available; using "
              f"{cores}", file=sys.stderr)
        args.workers = cores
    progress = Progress()
    try:
        cfg = PreprocessConfig(inputs=expand_inputs(args.input), tokenizer=args.tokenizer,
                               output_prefix=args.output_prefix, json_keys=args.json_keys, txt_mode=args.txt_mode,
                               workers=args.workers, append_eos=args.append_eos, prepend_bos=args.prepend_bos,
                               batch_bytes=int(args.batch_mb * (1 << 20)))
        print(f"preprocess_data: {len(cfg.inputs)} file(s) -> {cfg.output_prefix} with {cfg.workers} worker(s)",
              file=sys.stderr, flush=True)
        stats = preprocess(cfg, None if args.quiet else progress)
    except KeyboardInterrupt:
        print(f"{progress.end_line()}preprocess_data: interrupted; no output written", file=sys.stderr)
        return 130
    except (ValueError, ImportError, FileNotFoundError) as e:  # the input or the options
        print(f"{progress.end_line()}preprocess_data: error: {e}\nno output written", file=sys.stderr)
        return 2
    except OSError as e:  # reading or writing failed
        print(f"{progress.end_line()}preprocess_data: error: {e}\nno output written", file=sys.stderr)
        return 1
    print(f"{progress.end_line()}done in {stats.seconds:.1f}s: {stats.files} file(s), {stats.rates()}",
          file=sys.stderr)
    print(f"skipped: {stats.skips.report()}", file=sys.stderr)
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
