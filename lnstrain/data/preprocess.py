"""Corpus -> Megatron token files: streaming, N worker processes, constant memory, atomic outputs.

The main process reads raw records and writes token files; workers decode (UTF-8, JSON), tokenize and
return compact numpy arrays. At most ``2 * workers`` batches are in flight, so memory does not grow
with the corpus, and results are written in input order, so the output is deterministic.

Parquet and Arrow inputs take the same path: the main process reads record batches of the text
columns only (pyarrow's decoding runs in C++, far faster than tokenizing), cuts them to the same
size limits as JSON batches, and sends each to a worker as Arrow IPC; the worker makes the Python
strings. Work is split below the row group, so one file or one large row group still feeds every worker.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .arrow_corpus import ArrowRecords, column_texts, iter_text_batches
from .corpus_readers import ARROW_FORMATS, SkipCounts, check_inputs, file_format, iter_records, record_texts
from .indexed_dataset import token_dtype_for_vocab
from .indexed_writer import IndexedDatasetWriter
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Job = tuple[str, str, int, "list[bytes] | ArrowRecords"]  # (path, format, number of its first record, records)


@dataclass
class PreprocessConfig:
    """Options of tools/preprocess_data.py."""

    inputs: list[str]
    tokenizer: str
    output_prefix: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])  # JSON keys, or columns of Parquet/Arrow inputs
    txt_mode: str = "line"
    workers: int = 1
    append_eos: bool = True
    prepend_bos: bool = False
    batch_bytes: int = 1 << 20
    batch_docs: int = 2048


@dataclass
class PreprocessStats:
    """Running totals; ``skips`` counts every record or document left out and why.

    ``documents`` counts documents written (with several JSON keys: those of the first key);
    ``tokens`` counts tokens written over all outputs, EOS/BOS included.
    """

    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    files: int = 0
    seconds: float = 0.0
    encode_cpu_seconds: float = 0.0  # CPU time spent decoding + tokenizing + packing (all workers together)
    skips: SkipCounts = field(default_factory=SkipCounts)
    outputs: list[str] = field(default_factory=list)

    def rates(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"{self.documents} docs ({self.documents / s:,.0f} docs/s), {self.bytes_read / 1e6:,.1f} MB "
                f"({self.bytes_read / 1e6 / s:,.2f} MB/s), {self.tokens:,} tokens ({self.tokens / s:,.0f} tokens/s)")


# --- worker side -----------------------------------------------------------------------------------
class BatchEncoder:
    """Turns a batch of raw records into per-key (concatenated tokens, lengths) plus skip counts."""

    def __init__(self, model_path: str, keys: list[str], append_eos: bool, prepend_bos: bool):
        self.tok = Tokenizer(model_path)
        self.keys, self.eos, self.bos = keys, append_eos, prepend_bos
        self.dtype = token_dtype_for_vocab(self.tok.vocab_size)

    def __call__(self, job: Job):
        cpu0 = time.process_time()
        path, fmt, first_record, records = job
        skips = SkipCounts()
        if isinstance(records, ArrowRecords):
            texts_per_key = column_texts(records.batch, self.keys, skips, path, first_record)
        else:
            texts_per_key = [[] for _ in self.keys]
            for i, record in enumerate(records):
                for k, text in enumerate(record_texts(record, fmt, self.keys, skips, path, first_record + i)):
                    if text is not None:
                        texts_per_key[k].append(text)
        packed = [self._pack(self.tok.encode_batch(texts) if texts else []) for texts in texts_per_key]
        return packed, skips, time.process_time() - cpu0

    def _pack(self, ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Concatenate token lists (adding BOS/EOS per document) without a Python loop over tokens."""
        raw = np.fromiter((len(x) for x in ids), np.int64, len(ids))
        lengths = raw + int(self.bos) + int(self.eos)
        flat = np.empty(int(lengths.sum()), self.dtype)
        body = np.ones(len(flat), bool)
        starts = np.cumsum(lengths) - lengths
        if self.bos:
            flat[starts], body[starts] = self.tok.bos_id, False
        if self.eos:
            flat[starts + lengths - 1], body[starts + lengths - 1] = self.tok.eos_id, False
        flat[body] = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(raw.sum()))
        return flat, lengths


_WORKER_ENCODER: list[BatchEncoder] = []  # set once in each worker process by _init_worker


def _init_worker(*args) -> None:
    _WORKER_ENCODER.append(BatchEncoder(*args))


def _encode_in_worker(job):
    return _WORKER_ENCODER[0](job)


# --- main side -------------------------------------------------------------------------------------
def _jobs(cfg: PreprocessConfig, stats: PreprocessStats) -> Iterator[Job]:
    for path in cfg.inputs:
        fmt = file_format(path)
        if fmt in ARROW_FORMATS:
            yield from _arrow_jobs(cfg, stats, path, fmt)
            continue
        batch: list[bytes] = []
        size, first, n = 0, 1, 0
        for n, record in enumerate(iter_records(path, cfg.txt_mode), 1):
            batch.append(record)
            size += len(record)
            stats.bytes_read += len(record)
            if size >= cfg.batch_bytes or len(batch) >= cfg.batch_docs:
                yield path, fmt, first, batch
                batch, size, first = [], 0, n + 1
        if batch:
            yield path, fmt, first, batch
        if n == 0:
            stats.skips.add("empty file", path)
            logger.warning("%s: empty input file (no records)", path)
        stats.files += 1


def _arrow_jobs(cfg: PreprocessConfig, stats: PreprocessStats, path: str, fmt: str) -> Iterator[Job]:
    rows = 0
    for first_row, batch, text_bytes in iter_text_batches(path, cfg.json_keys, cfg.batch_docs, cfg.batch_bytes):
        stats.bytes_read += text_bytes
        rows += batch.num_rows
        yield path, fmt, first_row, ArrowRecords(batch)
    if rows == 0:
        stats.skips.add("empty file", path)
        logger.warning("%s: empty input file (no rows)", path)
    stats.files += 1


def output_prefixes(cfg: PreprocessConfig) -> list[str]:
    """One output per JSON key (or column): ``<prefix>`` for a single key, ``<prefix>_<key>`` for several."""
    if len(cfg.json_keys) == 1:
        return [cfg.output_prefix]
    return [f"{cfg.output_prefix}_{key}" for key in cfg.json_keys]


def check_tokenizer(cfg: PreprocessConfig) -> Tokenizer:
    tok = Tokenizer(cfg.tokenizer)
    if cfg.append_eos and tok.eos_id < 0:
        raise ValueError(f"{cfg.tokenizer} has no EOS token; retrain with --eos-id or pass --no-append-eos")
    if cfg.prepend_bos and tok.bos_id < 0:
        raise ValueError(f"{cfg.tokenizer} has no BOS token; retrain with --bos-id or drop --prepend-bos")
    return tok


def preprocess(cfg: PreprocessConfig, progress: Callable[[PreprocessStats], None] | None = None,
               progress_every_s: float = 1.0) -> PreprocessStats:
    """Tokenize ``cfg.inputs`` into ``<output_prefix>.bin/.idx``; outputs appear only on success."""
    if not cfg.json_keys:
        raise ValueError("at least one JSON key is needed (--json-keys text)")
    tok = check_tokenizer(cfg)
    check_inputs(cfg.inputs, cfg.json_keys)
    dtype = token_dtype_for_vocab(tok.vocab_size)
    stats = PreprocessStats(outputs=output_prefixes(cfg))
    writers = [IndexedDatasetWriter(p, dtype) for p in stats.outputs]
    init_args = (cfg.tokenizer, cfg.json_keys, cfg.append_eos, cfg.prepend_bos)
    t0 = last = time.perf_counter()
    pool = None
    try:
        if cfg.workers > 1:
            pool = mp.get_context("spawn").Pool(cfg.workers, _init_worker, init_args)
            results = _ordered_parallel(pool, _jobs(cfg, stats), 2 * cfg.workers)
        else:
            results = map(BatchEncoder(*init_args), _jobs(cfg, stats))
        for per_key, skips, cpu_seconds in results:
            stats.skips.merge(skips)
            stats.encode_cpu_seconds += cpu_seconds
            for writer, (flat, lengths) in zip(writers, per_key):
                writer.add_documents(flat, lengths)
            stats.documents += len(per_key[0][1])
            stats.tokens += sum(len(flat) for flat, _ in per_key)
            now = time.perf_counter()
            if progress and now - last >= progress_every_s:
                stats.seconds, last = now - t0, now
                progress(stats)
        if stats.documents == 0:
            raise ValueError(f"no documents written: every record was skipped ({stats.skips.report()}); "
                             f"check --json-keys (now {cfg.json_keys}) and the input files")
        for writer in writers:
            writer.finalize()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    stats.seconds = time.perf_counter() - t0
    return stats


def _ordered_parallel(pool, jobs: Iterator, max_in_flight: int) -> Iterator:
    """Like ``pool.imap`` but with at most ``max_in_flight`` pending jobs (``imap`` reads ahead unboundedly)."""
    pending: deque = deque()
    for job in jobs:
        pending.append(pool.apply_async(_encode_in_worker, (job,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
