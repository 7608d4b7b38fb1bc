#!/usr/bin/env python
"""Benchmark the data path and print the figures recorded in docs/data.md.

    python tools/benchmark_data.py                  # everything (about a minute on 2 cores)
    python tools/benchmark_data.py --skip-index     # without the 10B-token index build
    python tools/benchmark_data.py --index-only     # only the 10B-token index build and its check

1. Preprocessing: tokens per CPU-second of sentencepiece's encode in a bare loop vs the pipeline per worker
   (1 worker in process doing everything; 2..N spawned workers, whose own CPU time is measured), plus wall-clock
   throughput, on the demo corpus repeated to --corpus-mb, as .jsonl, as Parquet (row groups of 1,000 rows,
   snappy, as FineWeb's shards) and as an Arrow stream file (what datasets' save_to_disk writes; needs pyarrow).
   For the spawned runs, the main process's CPU time per MB (reading and writing) says how many workers it feeds.
2. Packed-sample and blend indices for --index-tokens tokens in --index-docs documents (one core, vectorised
   numpy), and the check of each when read from the cache (``index_check``): by a rank for itself, and with
   check records (``check_records``) by the first rank of a node and by each of the others.
3. Batch loader: tokens/s delivered by iterate_micro_batches in one process.

CPU seconds (time.process_time) are reported next to wall time because a shared machine inflates wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch  # noqa: F401  (imported up front so the loader timing does not include torch's import)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.data import (CheckRecords, DataConfig, DataSource, IndexCache, Tokenizer, build_train_valid_datasets,  # noqa: E402
                           check_records, iterate_micro_batches)
from lnstrain.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from lnstrain.data.index_check import blend_index_problem, packed_index_problem  # noqa: E402
from lnstrain.data.sample_index import build_blend_index, build_packed_index  # noqa: E402
from lnstrain.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

TOOLS = os.path.dirname(os.path.abspath(__file__))


def prepare(work: str, corpus_mb: float, vocab: int, tokenizer: str | None) -> tuple[str, str, list[str]]:
    sys.path.insert(0, TOOLS)
    import make_demo_corpus
    demo = os.path.join(work, "demo")
    make_demo_corpus.main(["--output", demo, "--max-mb", "100"])
    with open(os.path.join(demo, "train.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    if tokenizer is None:
        tokenizer = os.path.join(work, "spm.model")
        train_tokenizer(TokenizerTrainingConfig(inputs=[], output_prefix=tokenizer[:-6], vocab_size=vocab),
                        [os.path.join(demo, "train.jsonl")])
    size = sum(len(d.encode()) for d in docs)
    copies = max(1, round(corpus_mb * 1e6 / size))
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(copies):
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    return corpus, tokenizer, docs * copies


def write_tables(work: str, docs: list[str]) -> dict[str, str]:
    """The documents as a Parquet file and as an Arrow IPC stream (batches of 1,000 rows each, like datasets)."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401  (imported here, so that no timed run pays for pyarrow's imports)
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), "text": docs})
    paths = {"parquet": os.path.join(work, "corpus.parquet"), "arrow": os.path.join(work, "data-00000-of-00001.arrow")}
    pq.write_table(table, paths["parquet"], row_group_size=1000, compression="snappy")
    with pa.OSFile(paths["arrow"], "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
    return paths


def _timed(fn):
    """(result, wall seconds, CPU seconds of this process): CPU time is robust on a shared machine."""
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - w0, time.process_time() - c0


def bench_preprocess(work: str, corpus: str, tokenizer: str, docs: list[str], max_workers: int) -> None:
    tok = Tokenizer(tokenizer)
    sp = tok.sp
    n, wall, cpu_bare = _timed(lambda: sum(len(sp.EncodeAsIds(d)) for d in docs))
    bare = n / cpu_bare
    n_b, wall_b, cpu_b = _timed(lambda: sum(len(x) for i in range(0, len(docs), 2048)
                                            for x in sp.Encode(docs[i:i + 2048], num_threads=1)))
    mb = os.path.getsize(corpus) / 1e6
    print(f"\n[1] preprocessing {mb:.1f} MB, {len(docs)} docs, vocab {tok.vocab_size} ({n:,} tokens + EOS)")
    print(f"  sentencepiece bare loop, EncodeAsIds per doc: {bare:11,.0f} tokens/CPU-s ({n / wall:,.0f} tokens/s wall)")
    print(f"  sentencepiece batched Encode, 1 thread:       {n_b / cpu_b:11,.0f} tokens/CPU-s "
          f"({n_b / wall_b:,.0f} tokens/s wall)")
    inputs = {"jsonl": corpus}
    try:
        inputs.update(write_tables(work, docs))
    except ImportError:
        print("  (pyarrow is not installed: Parquet and Arrow inputs not measured)")
    for fmt, path in inputs.items():
        decode = "JSON" if fmt == "jsonl" else "to str"
        for workers in range(1, max_workers + 1):
            stats, wall, cpu = _timed(lambda: preprocess(PreprocessConfig(
                inputs=[path], tokenizer=tokenizer, workers=workers,
                output_prefix=os.path.join(work, f"tok_{fmt}_w{workers}"))))
            if workers == 1:  # everything (read, decode, tokenize, write) in this one process
                per_worker = stats.tokens / cpu
                label = f"1 worker, in process (read+{decode}+encode+write)"
                main = ""
            else:
                per_worker = stats.tokens / stats.encode_cpu_seconds
                label = f"{workers} spawned workers ({decode}+encode+pack)"
                main = f"; main process {stats.bytes_read / 1e6 / cpu:5.1f} MB/CPU-s"
            print(f"  {fmt:7s} {label:46s}: {per_worker:11,.0f} tokens/CPU-s per worker = {per_worker / bare:4.2f}x "
                  f"bare loop; wall: {stats.tokens / stats.seconds:11,.0f} tokens/s, "
                  f"{stats.bytes_read / 1e6 / stats.seconds:5.2f} MB/s{main}")
    text_mb = sum(len(d.encode()) for d in docs) / 1e6
    rates = [f"tokenizing (bare loop) {text_mb / cpu_bare:,.1f}"]
    for fmt, path in inputs.items():
        _, _, cpu_read = _timed(lambda: sum(1 for _ in _texts(fmt, path)))
        rates.append(f"{fmt} read + decode to str {text_mb / cpu_read:,.0f}")
    print(f"  MB of text per CPU-s, one process: {'; '.join(rates)}")


def _texts(fmt: str, path: str):
    """The documents of ``path`` as Python strings, as the pipeline reads and decodes them (no tokenizing)."""
    from lnstrain.data.arrow_corpus import column_texts, iter_text_batches
    from lnstrain.data.corpus_readers import SkipCounts, iter_records, record_texts

    skips = SkipCounts()
    if fmt == "jsonl":
        for record in iter_records(path):
            yield record_texts(record, "jsonl", ["text"], skips)[0]
        return
    for first_row, batch, _ in iter_text_batches(path, ["text"], 2048, 1 << 20):
        yield from column_texts(batch, ["text"], skips, path, first_row)[0]


def _settled(path: str) -> None:
    """Wait until the files under ``path`` changed long enough ago for a check record to be trusted."""
    newest = max(os.stat(os.path.join(path, name)).st_ctime for name in os.listdir(path) if name.endswith(".npy"))
    time.sleep(max(0.0, newest + check_records.SETTLED_S + 0.1 - time.time()))


def _cached_check(work: str, name: str, index: dict[str, np.ndarray], check) -> list[tuple[float, float]]:
    """``index`` written to a cache in ``work``, then read back by three ranks of one node: (wall, CPU)
    seconds of one that checks it for itself (as every rank did before check records), of the first
    one sharing records (checks and records), and of the next (trusts the record)."""
    IndexCache(work, builds=True).get_or_build(name, {}, lambda: index, check)  # writes and compares only
    _settled(work)
    times = []
    for records in (None, CheckRecords.for_this_node(work), CheckRecords.for_this_node(work)):
        arrays, wall, cpu = _timed(lambda: IndexCache(work, builds=False, records=records).get_or_build(
            name, {}, lambda: index, check))
        assert all(np.array_equal(arrays[key], index[key]) for key in index)
        times.append((wall, cpu))
    return times


def _print_check(times: list[tuple[float, float]]) -> None:
    (wall, cpu), (wall_first, cpu_first), (wall_next, cpu_next) = times
    print(f"  {'':14}its check, read from the cache, by each rank:   {cpu:6.2f} CPU-s ({wall:6.2f} s wall)")
    print(f"  {'':14}with check records: the node's first rank {cpu_first:6.2f} CPU-s ({wall_first:6.2f} s wall), "
          f"each other rank {cpu_next * 1e3:.1f} CPU-ms ({wall_next * 1e3:.1f} ms wall)")


def bench_index(num_docs: int, num_tokens: float, seq_lens: list[int]) -> None:
    rng = np.random.default_rng(0)
    sizes = rng.lognormal(0.0, 1.0, num_docs)
    sizes = np.maximum(1, sizes * (num_tokens / sizes.sum())).astype(np.int32)
    total = int(sizes.sum(dtype=np.int64))
    documents = np.arange(num_docs)
    print(f"\n[2] packed-sample index: {num_docs:,} documents, {total / 1e9:.2f}B tokens (one core, numpy)")
    with tempfile.TemporaryDirectory() as work:
        for seq_len in seq_lens:
            num_samples = (total - 1) // seq_len
            index, wall, cpu = _timed(lambda: build_packed_index(sizes, documents, seq_len, num_samples, 1234))
            mb = sum(a.nbytes for a in index.values()) / 1e6
            print(f"  seq_len {seq_len:5d}: {num_samples:12,} samples in {cpu:6.2f} CPU-s ({wall:6.2f} s wall), "
                  f"{mb:,.0f} MB of index")
            _print_check(_cached_check(work, f"packed{seq_len}", index, lambda arrays: packed_index_problem(
                arrays, sizes, documents, seq_len, num_samples)))
            del index
        for seq_len in seq_lens:
            num_samples = (total - 1) // seq_len
            weights = [0.5, 0.3, 0.2]
            index, wall, cpu = _timed(lambda: build_blend_index(weights, num_samples))
            print(f"  3-way blend index for {num_samples:12,} samples: {cpu:6.2f} CPU-s ({wall:6.2f} s wall)")
            _print_check(_cached_check(work, f"blend{seq_len}", index, lambda arrays: blend_index_problem(
                arrays, weights, num_samples)))


def bench_loader(work: str, prefix: str, tokenizer: str) -> None:
    print("\n[3] batch loader (iterate_micro_batches, one process)")
    for mode, seq_len, mb, sources in [("packed", 2048, 4, 1), ("packed", 256, 32, 2), ("truncate_pad", 256, 32, 1)]:
        cfg = DataConfig(sources=[DataSource(prefix, 1.0 + k) for k in range(sources)], seq_len=seq_len,
                         tokenizer=tokenizer, mode=mode, valid_fraction=0.0, cache_dir=os.path.join(work, "cache"))
        num = 256 * (16384 // seq_len)
        train, _ = build_train_valid_datasets(cfg, num, 0, seed=1, builds_cache=True)
        tokens, wall, cpu = _timed(lambda: sum(b["tokens"].numel()
                                               for b in iterate_micro_batches(train, 0, mb * 8, mb, 0, 1)))
        print(f"  {mode:12s} seq_len {seq_len:5d} mb {mb:3d} blend of {sources}: {tokens / cpu:12,.0f} tokens/CPU-s "
              f"({tokens / wall:12,.0f} tokens/s wall)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--corpus-mb", type=float, default=16.0, help="demo corpus repeated to about this size")
    p.add_argument("--vocab-size", type=int, default=8000, help="tokenizer trained on the demo corpus")
    p.add_argument("--tokenizer", default=None, help="use this .model instead of training one")
    p.add_argument("--max-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--index-docs", type=int, default=10_000_000)
    p.add_argument("--index-tokens", type=float, default=10e9)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 256])
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--index-only", action="store_true", help="section 2 only: the index build and its check")
    args = p.parse_args(argv)
    print(f"benchmark_data: {os.cpu_count()} cores, numpy {np.__version__}")
    if args.index_only:
        bench_index(args.index_docs, args.index_tokens, args.seq_lens)
        return 0
    with tempfile.TemporaryDirectory() as work:
        corpus, tokenizer, docs = prepare(work, args.corpus_mb, args.vocab_size, args.tokenizer)
        bench_preprocess(work, corpus, tokenizer, docs, args.max_workers)
        if not args.skip_index:
            bench_index(args.index_docs, args.index_tokens, args.seq_lens)
        bench_loader(work, os.path.join(work, "tok_jsonl_w1"), tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
