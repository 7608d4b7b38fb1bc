"""Streaming readers for raw corpora: ``.jsonl``/``.json``/``.txt``, optionally ``.gz`` or ``.zst`` compressed,
and (through ``arrow_corpus``) Parquet files and ``datasets`` directories written by ``save_to_disk``.

Everything streams record by record (Parquet and Arrow: record batch by record batch), so memory stays
constant whatever the file size. JSON and text records are returned as raw ``bytes``: decoding (UTF-8,
JSON) happens where the work is parallel (the workers).
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
from typing import IO, Iterator

from .arrow_corpus import (ARROW_SUFFIXES, PARQUET_SUFFIXES, CorpusError, check_text_columns, column_texts,
                           dataset_dir_files, iter_text_batches)
from .skip_counts import SkipCounts

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
TXT_MODES = ("line", "blank_line", "file")
ARROW_FORMATS = ("parquet", "arrow")  # read by columns, batch by batch (arrow_corpus)


def expand_inputs(patterns: list[str]) -> list[str]:
    """Expand files, globs and ``save_to_disk`` directories (in the order given, each glob sorted, a
    directory into its Arrow files in row order); error on no match."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"input pattern {pattern!r} matches no file")
        for path in matches:
            if os.path.isdir(path):
                files.extend(dataset_dir_files(path))
            elif not os.path.isfile(path):
                raise FileNotFoundError(f"input file not found: {path}")
            else:
                files.append(path)
    return files


def split_compression(path: str) -> tuple[str, str]:
    """``("corpus.jsonl", ".zst")`` for ``corpus.jsonl.zst``; compression is "" when uncompressed."""
    for ext in (".gz", ".zst"):
        if path.endswith(ext):
            return path[: -len(ext)], ext
    return path, ""


def file_format(path: str) -> str:
    """``"jsonl"``, ``"txt"``, ``"parquet"`` or ``"arrow"`` from the name; a clear error for anything else."""
    if path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if path.endswith(ARROW_SUFFIXES):
        return "arrow"
    base, _ = split_compression(path)
    if base.endswith(JSON_SUFFIXES):
        return "jsonl"
    if base.endswith(TEXT_SUFFIXES):
        return "txt"
    raise CorpusError(f"{path}: unknown input format; expected .jsonl/.json/.txt (optionally with .gz or .zst), "
                      ".parquet, .arrow, or a directory written by datasets' save_to_disk")


def check_inputs(paths: list[str], keys: list[str]) -> None:
    """Fail before any work on a file of unknown format, or a Parquet/Arrow file without the text
    column(s) ``keys`` as strings (JSON keys can only be checked record by record, and are)."""
    for path in paths:
        if file_format(path) in ARROW_FORMATS:
            check_text_columns(path, keys)


def open_binary(path: str) -> IO[bytes]:
    """Open a possibly compressed file for streaming binary reads."""
    _, comp = split_compression(path)
    if comp == ".gz":
        return gzip.open(path, "rb")
    if comp == ".zst":
        try:
            import zstandard
        except ImportError as e:
            raise ImportError(f"{path}: reading .zst files needs the optional 'zstandard' package "
                              "(pip install zstandard)") from e
        raw = open(path, "rb")
        reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, 1 << 20)
    return open(path, "rb", buffering=1 << 20)


def iter_records(path: str, txt_mode: str = "line") -> Iterator[bytes]:
    """Raw records of one file: JSON lines, or text lines / blank-line paragraphs / the whole file."""
    fmt = file_format(path)
    if fmt in ARROW_FORMATS:
        raise ValueError(f"{path}: a {fmt} file has no line records; read it with arrow_corpus.iter_text_batches")
    if txt_mode not in TXT_MODES:
        raise ValueError(f"txt_mode must be one of {TXT_MODES} (got {txt_mode!r})")
    with open_binary(path) as f:
        if fmt == "jsonl" or txt_mode == "line":
            for line in f:
                if line.strip():
                    yield line
        elif txt_mode == "file":
            data = f.read()
            if data.strip():
                yield data
        else:
            para: list[bytes] = []
            for line in f:
                if line.strip():
                    para.append(line)
                elif para:
                    yield b"".join(para)
                    para = []
            if para:
                yield b"".join(para)


def record_texts(record: bytes, fmt: str, keys: list[str], skips: SkipCounts, path: str = "",
                 record_no: int = 0) -> list[str | None]:
    """Decode one record into one text per key (None where that key is skipped; the reason is counted).

    ``path`` and ``record_no`` only name the record in skip reports.
    """
    try:
        text = record.decode("utf-8")
    except UnicodeDecodeError as e:
        skips.add("invalid UTF-8", f"{path} record {record_no}: {e.reason} at byte {e.start}", len(keys))
        return [None] * len(keys)
    if fmt == "txt":
        return [text.strip("\n")] * len(keys)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        skips.add("invalid JSON", f"{path} record {record_no}: {e.msg}", len(keys))
        return [None] * len(keys)
    if not isinstance(obj, dict):
        skips.add("JSON record not an object", f"{path} record {record_no}", len(keys))
        return [None] * len(keys)
    out: list[str | None] = []
    for key in keys:
        value = obj.get(key)
        if not isinstance(value, str):
            reason = f"missing JSON key {key!r}" if value is None else f"JSON key {key!r} not a string"
            skips.add(reason, f"{path} record {record_no}: keys present: {sorted(obj)[:8]}")
            out.append(None)
        elif not value.strip():
            skips.add("empty document", f"{path} record {record_no}")
            out.append(None)
        else:
            out.append(value)
    return out


def iter_documents(paths: list[str], keys: list[str] | tuple[str, ...] = ("text",), txt_mode: str = "line",
                   skips: SkipCounts | None = None) -> Iterator[str]:
    """Texts of every usable document in ``paths`` (sequentially, streaming); skips are counted in ``skips``.

    ``keys`` are the JSON keys or, for Parquet and Arrow files, the columns: each record gives one
    document per key (a .txt record one document)."""
    skips = skips if skips is not None else SkipCounts()
    keys = list(keys)
    for path in paths:
        fmt = file_format(path)
        empty = True
        if fmt in ARROW_FORMATS:
            check_text_columns(path, keys)
            for first_row, batch, _ in iter_text_batches(path, keys, max_rows=1024, max_bytes=1 << 22):
                empty = False
                for texts in column_texts(batch, keys, skips, path, first_row):
                    yield from texts
            if empty:
                skips.add("empty file", path)
            continue
        for i, record in enumerate(iter_records(path, txt_mode)):
            empty = False
            texts = record_texts(record, fmt, keys if fmt != "txt" else keys[:1], skips, path, i + 1)
            yield from (text for text in texts if text is not None)
        if empty:
            skips.add("empty file", path)
