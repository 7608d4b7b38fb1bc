"""Parquet files and Hugging Face ``datasets`` directories as corpora: the same token files as the same
documents through .jsonl, bounded memory, and one clear error (exit 2) for a bad column or shard."""
from __future__ import annotations

import json
import os
import pickle
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lnstrain.data.arrow_corpus import ArrowRecords, iter_text_batches
from lnstrain.data.corpus_readers import expand_inputs
from lnstrain.data.preprocess import PreprocessConfig, preprocess
from lnstrain.data.tokenizer_training import TokenizerTrainingConfig, reservoir_sample
from tests.tool_scripts import load_tool


def _read(prefix: str) -> list[bytes]:
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


@pytest.fixture(scope="module")
def corpus(demo_docs, tmp_path_factory) -> dict:
    """The same 400 rows as .jsonl, as two Parquet files (small row groups, two codecs) and as a directory
    written by the real ``datasets.save_to_disk`` (3 shards); some titles null, one text blank."""
    import datasets

    root = tmp_path_factory.mktemp("tables")
    texts = demo_docs[:396] + ["naïve café — 日本語 ✓ \U0001F600", "  leading and trailing  \n", "   ", "x"]
    titles = [None if i % 9 == 4 else f"Title {i}: {text[:20]}" for i, text in enumerate(texts)]
    ids = list(range(len(texts)))
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, title, text in zip(ids, titles, texts):
            f.write(json.dumps({"id": i, "title": title, "text": text}) + "\n")
    table = pa.table({"id": ids, "title": pa.array(titles, pa.string()), "text": pa.array(texts, pa.large_string())})
    pq.write_table(table.slice(0, 250), root / "part-0.parquet", row_group_size=64, compression="zstd")
    pq.write_table(table.slice(250), root / "part-1.parquet", row_group_size=40, compression="snappy")
    datasets.disable_progress_bars()
    saved = datasets.Dataset.from_dict({"id": ids, "title": titles, "text": texts})
    saved = saved.shuffle(seed=3)
    saved = saved.select(sorted(range(len(ids)), key=saved["id"].__getitem__))  # back in order, through an indices
    # mapping, which save_to_disk applies as it writes
    saved.save_to_disk(str(root / "saved"), num_shards=3)
    return {"jsonl": str(root / "corpus.jsonl"), "parquet": str(root / "part-*.parquet"),
            "saved": str(root / "saved"), "root": root, "texts": texts, "null_titles": titles.count(None)}


def test_parquet_and_saved_dataset_give_the_jsonl_token_files(corpus, tokenizer_model, tmp_path):
    """Byte-identical outputs for both columns, whatever the batching and the number of workers."""
    keys = ["title", "text"]
    reference = preprocess(PreprocessConfig(inputs=[corpus["jsonl"]], tokenizer=tokenizer_model, json_keys=keys,
                                            output_prefix=str(tmp_path / "jsonl")))
    nulls = corpus["null_titles"]
    assert nulls == 44 and reference.documents == 400 - nulls and reference.skips.total == nulls + 1  # + blank text
    expected = [_read(str(tmp_path / f"jsonl_{key}")) for key in keys]
    runs = {"parquet": dict(inputs=expand_inputs([corpus["parquet"]]), batch_docs=50, batch_bytes=8192),
            "parquet_2_workers": dict(inputs=expand_inputs([corpus["parquet"]]), workers=2, batch_docs=30),
            "saved": dict(inputs=expand_inputs([corpus["saved"]]))}
    assert len(runs["saved"]["inputs"]) == 3
    for name, options in runs.items():
        stats = preprocess(PreprocessConfig(tokenizer=tokenizer_model, json_keys=keys,
                                            output_prefix=str(tmp_path / name), **options))
        assert [_read(str(tmp_path / f"{name}_{key}")) for key in keys] == expected, name
        assert stats.documents == reference.documents and stats.tokens == reference.tokens
        assert stats.skips.counts == {"null in column 'title'": nulls, "empty document": 1}, name


def test_text_batches_respect_both_limits_and_cover_every_row(corpus):
    path = expand_inputs([corpus["parquet"]])[0]
    rows, first_rows = [], []
    for first_row, batch, text_bytes in iter_text_batches(path, ["text"], max_rows=7, max_bytes=3000):
        sizes = [len(t.encode()) for t in batch.column("text").to_pylist()]
        assert 1 <= batch.num_rows <= 7 and batch.column_names == ["text"] and text_bytes == sum(sizes)
        assert sum(sizes[:-1]) < 3000  # a batch stops at the row that reaches the limit
        first_rows.append(first_row)
        rows += batch.column("text").to_pylist()
    assert rows == corpus["texts"][:250]
    assert first_rows[0] == 1 and len(first_rows) > 250 // 7 + 1  # the byte limit cut some batches short
    # A slice sent to a worker carries only its own rows, not the batch it was cut from.
    batch = next(iter(pq.ParquetFile(path).iter_batches(batch_size=64, columns=["text"])))
    whole, one_row = len(pickle.dumps(ArrowRecords(batch))), pickle.dumps(ArrowRecords(batch.slice(3, 1)))
    assert len(one_row) < whole / 10
    assert pickle.loads(one_row).batch.column("text").to_pylist() == [corpus["texts"][3]]


def test_parquet_memory_does_not_grow_with_the_file(tmp_path):
    """pyarrow's allocations while a file is read stay the same for a file four times as large."""
    import numpy as np

    rng = np.random.default_rng(0)
    peaks = []
    for rows in (5000, 20000):
        letters = rng.integers(97, 123, size=(rows, 1000), dtype=np.uint8)
        path = str(tmp_path / f"{rows}.parquet")
        pq.write_table(pa.table({"text": [row.tobytes().decode() for row in letters]}), path, row_group_size=1000)
        del letters
        peak = 0
        for _, batch, _ in iter_text_batches(path, ["text"], max_rows=2048, max_bytes=1 << 20):
            peak = max(peak, pa.total_allocated_bytes())
            del batch
        peaks.append(peak)
    assert peaks[1] < 1.3 * peaks[0] and peaks[1] < 20e6 / 2, peaks  # 20 MB of text read with a few MB


def test_tokenizer_trains_on_parquet_exactly_as_on_jsonl(corpus, tmp_path, capsys):
    cfg = TokenizerTrainingConfig(inputs=[], output_prefix="unused", json_keys=["text"], max_sentences=300, seed=5)
    sample, stats = reservoir_sample(cfg, [corpus["jsonl"]])
    assert reservoir_sample(cfg, expand_inputs([corpus["saved"]]))[0] == sample
    tool = load_tool("train_tokenizer")
    models = []
    for name, source in [("jsonl", corpus["jsonl"]), ("parquet", corpus["parquet"])]:
        prefix = str(tmp_path / name)
        assert tool.main(["--input", source, "--json-keys", "text", "--vocab-size", "400",
                          "--output-prefix", prefix, "--threads", "1"]) == 0
        models.append(open(prefix + ".model", "rb").read())
    assert models[0] == models[1]


def _corrupt_page_header(path: str, out: str) -> None:
    """A copy whose third row group's page header is garbage (the footer still reads)."""
    column = pq.ParquetFile(path).metadata.row_group(2).column(2)
    data = bytearray(open(path, "rb").read())
    start = column.data_page_offset if column.dictionary_page_offset is None else column.dictionary_page_offset
    data[start + 10:start + 74] = b"\xff" * 64
    with open(out, "wb") as f:
        f.write(data)


def test_bad_columns_and_shards_are_one_clear_error(corpus, tokenizer_model, tmp_path, capsys, monkeypatch):
    tool = load_tool("preprocess_data")
    root = corpus["root"]
    good = str(root / "part-0.parquet")
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all" * 10)
    _corrupt_page_header(good, str(tmp_path / "torn.parquet"))
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "dict_dir").mkdir()
    (tmp_path / "dict_dir" / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    columns_present = "columns present: id (int64), title (string), text (large_string)"
    cases = [
        ([good, str(root / "part-1.parquet")], ["body"], [f"{good}: no column 'body'", columns_present, "with --json-keys"]),
        ([good], ["title", "id"], [f"{good}: column 'id' holds int64, not strings", columns_present]),
        ([corpus["saved"]], ["body"], ["data-00000-of-00003.arrow: no column 'body'", "text (string)"]),
        ([good, str(tmp_path / "garbage.parquet")], ["text"], ["garbage.parquet: unreadable Parquet file"]),
        ([str(tmp_path / "torn.parquet")], ["text"], ["torn.parquet: unreadable Parquet data at row 129 or after"]),
        ([str(tmp_path / "plain_dir")], ["text"], ["plain_dir: a directory, but not one written by datasets"]),
        ([str(tmp_path / "dict_dir")], ["text"], ["a DatasetDict with splits ['train', 'validation']",
                                                  os.path.join(str(tmp_path / "dict_dir"), "train")]),
    ]
    for inputs, keys, expected in cases:
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        code = tool.main(["--input", *inputs, "--tokenizer", tokenizer_model, "--output-prefix", str(out / "x"),
                          "--json-keys", *keys, "--workers", "1", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2, (inputs, err)
        assert err.count("error:") == 1 and "Traceback" not in err
        for fragment in expected:
            assert fragment in err, (fragment, err)
        assert os.listdir(out) == []  # nothing written, not even a temporary file
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert tool.main(["--input", good, "--tokenizer", tokenizer_model, "--output-prefix", str(tmp_path / "x")]) == 2
    assert "needs the optional 'pyarrow' package (pip install pyarrow" in capsys.readouterr().err


def test_invalid_utf8_in_a_string_column_is_skipped_and_counted(tmp_path, tokenizer_model):
    """pyarrow does not check UTF-8 when it reads; such a value is counted like invalid UTF-8 in JSON."""
    raw = pa.array([b"first good", b"bad \xff\xfe", b"second good"]).view(pa.string())
    path = str(tmp_path / "bytes.parquet")
    pq.write_table(pa.table({"text": raw}), path)
    stats = preprocess(PreprocessConfig(inputs=[path], tokenizer=tokenizer_model, output_prefix=str(tmp_path / "o")))
    assert stats.documents == 2
    assert stats.skips.counts == {"invalid UTF-8": 1}
    assert "bytes.parquet row 2: invalid start byte at byte 4" in stats.skips.report()
