#!/usr/bin/env python
"""What the launch's check of every token id costs (lnstrain/data/token_check.py), on a synthetic
token file of the given size.

    python tools/benchmark_token_check.py --dir /tmp/token_bench --gib 1.5

Writes <dir>/tokens.bin/.idx (uint16 ids below 32000, documents of 1,000 tokens), then times, each
--repeats times: the full scan with the page cache cold (posix_fadvise DONTNEED first: as on the first
launch after the data was written elsewhere), the full scan warm, and a launch that finds the cache
beside the .idx (stat of both files and their content fingerprint: the SHA-256 of the .idx and three
64 KiB samples of the .bin). Prints medians of wall-clock and CPU time and the scan's rate, from
which a 10B-token corpus's time follows. The files are deleted at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.help_formatter import HelpFormatter  # noqa: E402

DOCUMENT_TOKENS = 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dir", required=True, help="where to write the token file (deleted afterwards)")
    parser.add_argument("--gib", type=float, default=1.5, help="size of the .bin in GiB")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each kind")
    return parser.parse_args(argv)


def write_tokens(prefix: str, gib: float) -> int:
    import numpy as np

    from lnstrain.data import IndexedDatasetWriter

    tokens = int(gib * 2**30) // 2 // DOCUMENT_TOKENS * DOCUMENT_TOKENS
    chunk = 50_000 * DOCUMENT_TOKENS
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for start in range(0, tokens, chunk):
            count = min(chunk, tokens - start)
            writer.add_documents(rng.integers(0, 32000, count, dtype=np.uint16),
                                 np.full(count // DOCUMENT_TOKENS, DOCUMENT_TOKENS, np.int64))
    return tokens


def timed(action) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process) that ``action()`` took."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def drop_cached_pages(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lnstrain.data import token_check
    from lnstrain.data.fingerprint import _fingerprint

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    prefix = str(Path(args.dir) / "tokens")
    tokens = write_tokens(prefix, args.gib)
    cache = prefix + ".idx.lnstrain-range.json"
    cold, warm, cached = [], [], []
    for _ in range(args.repeats):
        for timings, drop in ((cold, True), (warm, False)):
            if os.path.exists(cache):
                os.unlink(cache)
            _fingerprint.cache_clear()
            if drop:
                drop_cached_pages(prefix + ".bin")
            timings.append(timed(lambda: token_check.token_id_range(prefix)))
        _fingerprint.cache_clear()  # a new launch: a new process
        cached.append(timed(lambda: token_check.token_id_range(prefix)))
    gib = os.path.getsize(prefix + ".bin") / 2**30
    print(f"{tokens / 1e9:.2f}B tokens, {gib:.2f} GiB uint16; medians of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"  {'':<18}{'wall s':>9}{'CPU s':>9}   wall rate, and 10B tokens at that rate")
    for label, values in (("full scan, cold", cold), ("full scan, warm", warm), ("cache found", cached)):
        wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
        rate = f"   {tokens / wall / 1e9:5.2f}B tokens/s, 10B: {10e9 * wall / tokens:6.1f} s" \
            if label.startswith("full") else ""
        print(f"  {label:<18}{wall:9.3f}{cpu:9.3f}{rate}")
    for suffix in (".bin", ".idx", ".idx.lnstrain-range.json"):
        os.unlink(prefix + suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
