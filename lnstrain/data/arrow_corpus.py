"""Parquet files and Hugging Face ``datasets`` directories as corpora, read with pyarrow batch by batch.

Parquet is read with ``ParquetFile.iter_batches``, one row group at a time, over the text columns
only, so memory is bounded by about one row group of those columns whatever the file size. A
directory written by ``datasets``' ``save_to_disk`` is a list of Arrow IPC files (in row order in its
``state.json``); they are read with pyarrow directly, so ``datasets`` itself is not needed.

A record batch leaves the reader holding only the text columns, cut to at most a number of rows and
of text bytes; turning it into Python strings is left to whoever encodes it (in preprocessing, the
worker processes). pyarrow is optional and imported only when such an input is read.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Iterator

import numpy as np

from .skip_counts import SkipCounts

if TYPE_CHECKING:
    import pyarrow

PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
DATASET_STATE = "state.json"
DATASET_DICT = "dataset_dict.json"
INSTALL_HINT = 'pip install pyarrow, or pip install -e ".[parquet]"'


class CorpusError(ValueError):
    """An input that cannot be read as asked; the message names the file and what it holds."""


def import_pyarrow(path: str):
    """pyarrow with its Parquet reader and compute functions; when missing, an ImportError saying how to install it."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{path}: reading Parquet and Arrow inputs needs the optional 'pyarrow' package "
                          f"({INSTALL_HINT})") from e
    return pyarrow


def dataset_dir_files(path: str) -> list[str]:
    """The Arrow files of a directory written by ``Dataset.save_to_disk``, in the order of their rows."""
    state_path = os.path.join(path, DATASET_STATE)
    dict_path = os.path.join(path, DATASET_DICT)
    if not os.path.isfile(state_path) and os.path.isfile(dict_path):
        splits = _read_json(dict_path).get("splits") or ["train"]
        raise CorpusError(f"{path}: a DatasetDict with splits {splits}; give one split's directory, "
                          f"e.g. {os.path.join(path, splits[0])}")
    if not os.path.isfile(state_path):
        raise CorpusError(f"{path}: a directory, but not one written by datasets' save_to_disk (no {DATASET_STATE}); "
                          f"give files or a glob such as {os.path.join(path, '*.parquet')}")
    try:
        names = [entry["filename"] for entry in _read_json(state_path)["_data_files"]]
    except (KeyError, TypeError) as e:
        raise CorpusError(f"{state_path}: not a datasets state file (no list of _data_files: {e!r})") from None
    files = [os.path.join(path, name) for name in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise CorpusError(f"{path}: {DATASET_STATE} lists {len(files)} data file(s) and {len(missing)} are missing, "
                          f"e.g. {missing[0]}")
    if not files:
        raise CorpusError(f"{state_path}: lists no data files")
    return files


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise CorpusError(f"{path}: expected a JSON object")
    return data


def _kind(path: str) -> str:
    return "Parquet" if path.endswith(PARQUET_SUFFIXES) else "Arrow"


def _unreadable(path: str, error: Exception) -> CorpusError:
    return CorpusError(f"{path}: unreadable {_kind(path)} file ({type(error).__name__}: {error})")


def _open_ipc(pa, source):
    """A reader of an Arrow IPC stream (what ``save_to_disk`` writes) or IPC file (Feather v2)."""
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_file(source)


def read_schema(path: str) -> "pyarrow.Schema":
    pa = import_pyarrow(path)
    try:
        if path.endswith(PARQUET_SUFFIXES):
            with pa.parquet.ParquetFile(path) as parquet:
                return parquet.schema_arrow
        with pa.OSFile(path) as source:
            return _open_ipc(pa, source).schema
    except (pa.ArrowException, OSError) as e:
        raise _unreadable(path, e) from None


def _is_text_type(pa, dtype) -> bool:
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or is_view(dtype)


def check_text_columns(path: str, columns: list[str]) -> None:
    """A CorpusError naming the file and the columns present unless every column is there and holds strings."""
    pa = import_pyarrow(path)
    schema = read_schema(path)
    present = ", ".join(f"{f.name} ({f.type})" for f in schema) or "none"
    for column in columns:
        if column not in schema.names:
            raise CorpusError(f"{path}: no column {column!r}; columns present: {present}. "
                              "name the text column with --json-keys")
        dtype = schema.field(column).type
        if not _is_text_type(pa, dtype):
            raise CorpusError(f"{path}: column {column!r} holds {dtype}, not strings; columns present: {present}")


def _record_batches(pa, path: str, columns: list[str], max_rows: int) -> Iterator["pyarrow.RecordBatch"]:
    if path.endswith(PARQUET_SUFFIXES):
        # One row group at a time: pyarrow's default pre_buffer reads the columns of every row group
        # asked for before the first batch, which for a whole file is the whole file.
        with pa.parquet.ParquetFile(path, pre_buffer=False) as parquet:
            for row_group in range(parquet.num_row_groups):
                yield from parquet.iter_batches(batch_size=max_rows, row_groups=[row_group], columns=columns)
        return
    with pa.OSFile(path) as source:
        reader = _open_ipc(pa, source)
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).select(columns)
        else:
            for batch in reader:
                yield batch.select(columns)


def text_bytes_per_row(pa, batch: "pyarrow.RecordBatch") -> np.ndarray:
    """UTF-8 bytes of text in each row, over all columns of ``batch`` (nulls count 0)."""
    sizes = np.zeros(batch.num_rows, np.int64)
    for column in batch.columns:
        sizes += pa.compute.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    return sizes


def iter_text_batches(path: str, columns: list[str], max_rows: int,
                      max_bytes: int) -> Iterator[tuple[int, "pyarrow.RecordBatch", int]]:
    """(number of the first row, from 1; a batch of ``columns`` only; its text bytes) through the file.

    A batch stops at ``max_rows`` rows or at the row that brings it to ``max_bytes`` (a longer row
    goes alone). Read and decompression errors become one CorpusError naming the file.
    """
    pa = import_pyarrow(path)
    batches = _record_batches(pa, path, columns, max_rows)
    row = 1
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise CorpusError(f"{path}: unreadable {_kind(path)} data at row {row} or after "
                              f"({type(e).__name__}: {e})") from None
        sizes = text_bytes_per_row(pa, batch)
        start = 0
        while start < batch.num_rows:
            cumulative = np.cumsum(sizes[start:start + max_rows])
            count = min(int(np.searchsorted(cumulative, max_bytes)) + 1, len(cumulative))
            yield row + start, batch.slice(start, count), int(cumulative[count - 1])
            start += count
        row += batch.num_rows


def column_texts(batch: "pyarrow.RecordBatch", columns: list[str], skips: SkipCounts, path: str,
                 first_row: int) -> list[list[str]]:
    """The usable texts of each column, in row order; null and blank values are counted in ``skips``."""
    per_column: list[list[str]] = []
    for column in columns:
        texts: list[str] = []
        for i, text in enumerate(_strings(batch.column(column), skips, path, first_row)):
            if text is _COUNTED:
                continue
            if text is None:
                skips.add(f"null in column {column!r}", f"{path} row {first_row + i}")
            elif not text or text.isspace():
                skips.add("empty document", f"{path} row {first_row + i}")
            else:
                texts.append(text)
        per_column.append(texts)
    return per_column


_COUNTED = object()  # a value already counted in the skips


def _strings(array, skips: SkipCounts, path: str, first_row: int) -> list:
    """The values as Python strings (None for null); pyarrow does not check UTF-8 when it reads, so a
    value that is not valid UTF-8 is found here, counted as skipped, and given as ``_COUNTED``."""
    try:
        return array.to_pylist()
    except UnicodeDecodeError:
        pass
    import pyarrow

    raw_type = pyarrow.large_binary() if pyarrow.types.is_large_string(array.type) else pyarrow.binary()
    values: list = []
    for i, raw in enumerate(array.cast(raw_type).to_pylist()):
        try:
            values.append(None if raw is None else raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            skips.add("invalid UTF-8", f"{path} row {first_row + i}: {e.reason} at byte {e.start}")
            values.append(_COUNTED)
    return values


class ArrowRecords:
    """A record batch that pickles as Arrow IPC holding only its own rows (pickling a slice directly
    would send the whole batch it was cut from); what preprocessing sends to a worker."""

    __slots__ = ("batch",)

    def __init__(self, batch: "pyarrow.RecordBatch"):
        self.batch = batch

    def __reduce__(self):
        return _records_from_ipc, (self.batch.schema, self.batch.serialize())


def _records_from_ipc(schema, buffer) -> ArrowRecords:
    import pyarrow

    return ArrowRecords(pyarrow.ipc.read_record_batch(buffer, schema))
