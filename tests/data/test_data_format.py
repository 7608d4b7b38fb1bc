"""On-disk format: files from an independent writer load here, ours load in an independent reader, and
corrupt or truncated files give errors that name the file and the problem."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from lnstrain.data import CorruptDatasetError, IndexedDataset, IndexedDatasetWriter, merge_datasets
from lnstrain.data.indexed_dataset import token_dtype_for_vocab
from lnstrain.data.splits import documents_to_sequences


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_independent_writer_fixture_loads(tmp_path, demo_token_docs, megatron_writer, dtype):
    # Megatron-style documents made of several sequences (the reader must keep the document index)
    seqs = demo_token_docs[:60]
    docs = [seqs[i:i + 3] for i in range(0, 60, 3)]
    if dtype == "int32":  # ids beyond uint16, as a vocabulary of >= 65,500 produces
        docs = [[[t + 70000 for t in s] for s in d] for d in docs]
    prefix = str(tmp_path / "megatron")
    megatron_writer(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 60 and ds.num_documents == 20
    assert list(ds.doc_idx) == list(range(0, 61, 3))
    flat = [s for d in docs for s in d]
    for i in (0, 1, 29, 59):
        assert ds[i].tolist() == flat[i]
        assert ds.get(i, 2, 5).tolist() == flat[i][2:7]
    assert ds.num_tokens == sum(len(s) for s in flat)
    # splitting by document keeps a document's sequences together
    assert documents_to_sequences(ds.doc_idx, np.array([1, 4])).tolist() == [3, 4, 5, 12, 13, 14]


def test_reader_is_zero_copy(demo_prefix):
    ds = IndexedDataset(demo_prefix)
    view = ds[5]
    assert isinstance(view.base, (np.memmap, np.ndarray)) and not view.flags.writeable
    assert not view.flags.owndata


def test_our_writer_loads_in_independent_reader(tmp_path, demo_token_docs, megatron_reader):
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for doc in demo_token_docs[:50]:
            w.add_document(doc)
    dtype, seqs, doc_idx = megatron_reader(prefix)
    assert dtype == "uint16" and seqs == demo_token_docs[:50] and doc_idx == list(range(51))


def test_dtype_rule():
    assert token_dtype_for_vocab(32000) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128256) == np.int32


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "x"), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        w.add_document(np.array([1, 70000], np.int64))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_writer_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_merge(tmp_path, demo_token_docs, megatron_writer, megatron_reader):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    megatron_writer(a, [[s] for s in demo_token_docs[:10]])
    megatron_writer(b, [demo_token_docs[10:13], [demo_token_docs[13]]])
    merged = merge_datasets([a, b], str(tmp_path / "m"))
    assert merged.num_documents == 12
    dtype, seqs, doc_idx = megatron_reader(str(tmp_path / "m"))
    assert seqs == demo_token_docs[:14]
    assert doc_idx == list(range(11)) + [13, 14]
    c = str(tmp_path / "c")
    megatron_writer(c, [[[1, 2]]], "int32")
    with pytest.raises(ValueError, match="different dtypes"):
        merge_datasets([a, c], str(tmp_path / "m2"))


# --- corruption -------------------------------------------------------------------------------------
def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str, delta: int) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size + delta)


def _append(path: str, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


CORRUPTIONS = {
    "bad magic": (lambda p: _patch(p + ".idx", 0, b"XXIDIDX"), ".idx", "bad magic"),
    "version": (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), ".idx", "unsupported version 2"),
    "dtype code": (lambda p: _patch(p + ".idx", 17, bytes([6])), ".idx", "unsupported dtype code 6"),
    "truncated idx": (lambda p: _truncate(p + ".idx", -8), ".idx", "truncated or corrupt"),
    "tiny idx": (lambda p: _truncate(p + ".idx", -(os.path.getsize(p + ".idx") - 20)), ".idx", "header"),
    "count": (lambda p: _patch(p + ".idx", 18, struct.pack("<Q", 11)), ".idx", "sequences=11"),
    "truncated bin": (lambda p: _truncate(p + ".bin", -2), ".bin", "truncated"),
    "long bin": (lambda p: _append(p + ".bin", b"\x00\x00"), ".bin", "longer than its index"),
    "pointer": (lambda p: _patch(p + ".idx", 34 + 4 * 10 + 8 * 3, struct.pack("<q", 7)), ".idx",
                "pointer of sequence 3"),
    "doc index end": (lambda p: _patch(p + ".idx", 34 + 12 * 10 + 8 * 10, struct.pack("<q", 9)), ".idx",
                      "end at 10"),
    "negative size": (lambda p: _patch(p + ".idx", 34 + 4 * 2, struct.pack("<i", -5)), ".idx", "negative"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_files_name_file_and_problem(tmp_path, demo_token_docs, megatron_writer, name):
    prefix = str(tmp_path / "d")
    megatron_writer(prefix, [[s] for s in demo_token_docs[:10]])
    IndexedDataset(prefix)  # valid before the damage
    damage, ext, message = CORRUPTIONS[name]
    damage(prefix)
    with pytest.raises(CorruptDatasetError) as err:
        IndexedDataset(prefix)
    assert (prefix + ext) in str(err.value) and message in str(err.value)


def test_missing_files(tmp_path, demo_token_docs, megatron_writer):
    with pytest.raises(FileNotFoundError, match="nothere.idx"):
        IndexedDataset(str(tmp_path / "nothere"))
    prefix = str(tmp_path / "d")
    megatron_writer(prefix, [[demo_token_docs[0]]])
    os.remove(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match="d.bin"):
        IndexedDataset(prefix)
