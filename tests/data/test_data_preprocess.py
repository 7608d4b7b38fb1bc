"""Corpus readers, tokenizer training and preprocessing: round trip on real text, formats, bad input."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lnstrain.data import IndexedDataset, Tokenizer
from lnstrain.data.corpus_readers import iter_records, open_binary
from lnstrain.data.preprocess import PreprocessConfig, preprocess
from lnstrain.data.tokenizer_training import TokenizerTrainingConfig, reservoir_sample
from tests.tool_scripts import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_lines(path, lines: list[bytes]) -> str:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
    return str(path)


def _jsonl(texts: list[str]) -> list[bytes]:
    return [json.dumps({"text": t}).encode() for t in texts]


def test_round_trip_real_text(demo_prefix, demo_docs, tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    ds = IndexedDataset(demo_prefix)
    assert len(ds) == len(demo_docs) > 1000
    assert ds.dtype == np.uint16
    for i in range(0, len(demo_docs), 7):
        tokens = ds[i]
        assert tokens[-1] == tok.eos_id and tok.eos_id not in tokens[:-1]
        assert tok.decode(tokens[:-1]) == demo_docs[i]  # identity normalisation + byte fallback: exact


def test_compressed_and_txt_inputs_match(tmp_path, demo_docs, tokenizer_model):
    docs = [d.replace("\n", " ") for d in demo_docs[:200]]  # one line per document for the .txt variant
    import zstandard
    plain = _write_lines(tmp_path / "c.jsonl", _jsonl(docs))
    gz = _write_lines(tmp_path / "c.jsonl.gz", _jsonl(docs))
    zst = str(tmp_path / "c.jsonl.zst")
    with open(zst, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(open(plain, "rb").read()))
    txt = _write_lines(tmp_path / "c.txt", [d.encode() for d in docs])
    outputs = []
    for name, path in [("plain", plain), ("gz", gz), ("zst", zst), ("txt", txt)]:
        prefix = str(tmp_path / name)
        stats = preprocess(PreprocessConfig(inputs=[path], tokenizer=tokenizer_model, output_prefix=prefix,
                                            batch_docs=37))
        assert stats.documents == 200 and stats.skips.total == 0
        outputs.append([open(prefix + ext, "rb").read() for ext in (".bin", ".idx")])
    assert all(o == outputs[0] for o in outputs[1:])


def test_workers_give_identical_output(tmp_path, demo_corpus, demo_prefix, tokenizer_model):
    prefix = str(tmp_path / "par")
    stats = preprocess(PreprocessConfig(inputs=[os.path.join(demo_corpus, "train.jsonl")], tokenizer=tokenizer_model,
                                        output_prefix=prefix, workers=2, batch_docs=64))
    assert stats.tokens == IndexedDataset(demo_prefix).num_tokens
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(demo_prefix + ext, "rb").read()


def test_bad_records_are_counted_and_reported(tmp_path, tokenizer_model):
    lines = _jsonl(["good one", "good two"]) + [
        b'{"content": "wrong key"}', b'{"text": ""}', b'{"text": "bad \xff\xfe utf8"}', b'{"text": 5}',
        b"not json at all", b"[1, 2]"]
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    empty = _write_lines(tmp_path / "empty.jsonl", [])
    stats = preprocess(PreprocessConfig(inputs=[path, empty], tokenizer=tokenizer_model,
                                        output_prefix=str(tmp_path / "out")))
    assert stats.documents == 2
    assert stats.skips.counts == {"missing JSON key 'text'": 1, "empty document": 1, "invalid UTF-8": 1,
                                  "JSON key 'text' not a string": 1, "invalid JSON": 1,
                                  "JSON record not an object": 1, "empty file": 1}
    report = stats.skips.report()
    assert "bad.jsonl record 3" in report and "keys present: ['content']" in report
    assert len(IndexedDataset(str(tmp_path / "out"))) == 2


def test_all_skipped_is_an_error_and_leaves_no_files(tmp_path, tokenizer_model):
    path = _write_lines(tmp_path / "c.jsonl", [b'{"body": "x"}'] * 3)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=r"no documents written.*--json-keys \(now \['text'\]\)"):
        preprocess(PreprocessConfig(inputs=[path], tokenizer=tokenizer_model, output_prefix=str(out / "x")))
    assert os.listdir(out) == []


def test_interrupted_run_leaves_no_valid_looking_file(tmp_path, demo_corpus, tokenizer_model):
    out = tmp_path / "out"
    out.mkdir()

    def interrupt(stats):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        preprocess(PreprocessConfig(inputs=[os.path.join(demo_corpus, "train.jsonl")], tokenizer=tokenizer_model,
                                    output_prefix=str(out / "x"), batch_docs=50), interrupt, progress_every_s=0)
    assert os.listdir(out) == []


def test_multiple_json_keys_and_bos(tmp_path, tokenizer_model):
    path = _write_lines(tmp_path / "c.jsonl", [json.dumps({"title": f"T{i}", "text": f"body {i}"}).encode()
                                               for i in range(5)])
    tok = Tokenizer(tokenizer_model)
    preprocess(PreprocessConfig(inputs=[path], tokenizer=tokenizer_model, output_prefix=str(tmp_path / "o"),
                                json_keys=["title", "text"], prepend_bos=True))
    titles, bodies = IndexedDataset(str(tmp_path / "o_title")), IndexedDataset(str(tmp_path / "o_text"))
    assert len(titles) == len(bodies) == 5
    assert titles[3][0] == tok.bos_id and titles[3][-1] == tok.eos_id
    assert tok.decode(bodies[3][1:-1]) == "body 3" and tok.decode(titles[4][1:-1]) == "T4"


def test_the_tokenizer_samples_every_key_it_is_given_as_preprocessing_reads_them(tmp_path):
    path = _write_lines(tmp_path / "c.jsonl", [json.dumps({"title": f"T{i}", "text": f"body {i}"}).encode()
                                               for i in range(3)])
    both = TokenizerTrainingConfig(inputs=[path], output_prefix="unused", json_keys=["title", "text"])
    sample, stats = reservoir_sample(both, [path])
    assert sorted(sample) == ["T0", "T1", "T2", "body 0", "body 1", "body 2"] and stats["documents"] == 6
    text_only, _ = reservoir_sample(TokenizerTrainingConfig(inputs=[path], output_prefix="unused"), [path])
    assert sorted(text_only) == ["body 0", "body 1", "body 2"]  # the default key, text


def test_zstd_missing_gives_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match="pip install zstandard"):
        open_binary(str(path))


def test_unknown_format_and_txt_modes(tmp_path):
    with pytest.raises(ValueError, match="unknown input format"):
        list(iter_records(str(tmp_path / "c.csv")))
    path = _write_lines(tmp_path / "c.txt", [b"a1", b"a2", b"", b"b1", b"", b""])
    assert list(iter_records(path, "line")) == [b"a1\n", b"a2\n", b"b1\n"]
    assert list(iter_records(path, "blank_line")) == [b"a1\na2\n", b"b1\n"]
    assert len(list(iter_records(path, "file"))) == 1


def test_reservoir_sample_is_bounded_and_uniform(tmp_path):
    path = _write_lines(tmp_path / "c.jsonl", _jsonl([f"line {i}" for i in range(5000)]))
    cfg = TokenizerTrainingConfig(inputs=[path], output_prefix="unused", max_sentences=500, seed=3)
    sample, stats = reservoir_sample(cfg, [path])
    assert len(sample) == 500 and stats["sentences"] == 5000
    ids = sorted(int(s.split()[1]) for s in sample)
    assert ids[0] < 250 and ids[-1] > 4750  # drawn from the whole file, not its head
    assert np.mean(ids) == pytest.approx(2500, rel=0.15)
    assert reservoir_sample(cfg, [path])[0] == sample  # deterministic


def test_cli_tools_end_to_end(tmp_path, demo_corpus):
    """The commands users run, exactly as in the docs (unigram with pad, a T5-like id layout)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    corpus = os.path.join(demo_corpus, "*.jsonl")
    tok = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", corpus, "--vocab-size", "400",
                          "--model-type", "unigram", "--output-prefix", str(tmp_path / "tok/spm"),
                          "--pad-id", "0", "--eos-id", "1", "--unk-id", "2", "--bos-id", "-1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert tok.returncode == 0, tok.stderr
    assert "trained unigram" in tok.stdout and os.path.isfile(tmp_path / "tok/spm.vocab")
    t = Tokenizer(str(tmp_path / "tok/spm.model"))
    assert (t.pad_id, t.eos_id, t.unk_id, t.bos_id, t.vocab_size) == (0, 1, 2, -1, 400)
    pre = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--tokenizer",
                          str(tmp_path / "tok/spm.model"), "--output-prefix", str(tmp_path / "data/c4_train"),
                          "--workers", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert pre.returncode == 0, pre.stderr
    assert "docs/s" in pre.stderr and "MB/s" in pre.stderr and "tokens/s" in pre.stderr
    ds = IndexedDataset(str(tmp_path / "data/c4_train"))
    assert ds[0][-1] == 1 and len(ds) > 1000
    merge = subprocess.run([sys.executable, "tools/merge_datasets.py", "--input", str(tmp_path / "data/c4_train"),
                            str(tmp_path / "data/c4_train"), "--output-prefix", str(tmp_path / "data/twice")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert merge.returncode == 0, merge.stderr
    assert len(IndexedDataset(str(tmp_path / "data/twice"))) == 2 * len(ds)
    bad = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "nope*.jsonl"),
                          "--tokenizer", str(tmp_path / "tok/spm.model"), "--output-prefix", str(tmp_path / "x")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "matches no file" in bad.stderr  # bad input: exit 2


def test_large_vocabulary_writes_int32(tmp_path, demo_corpus, demo_prefix, tokenizer_model, megatron_reader,
                                       monkeypatch):
    """A vocabulary of >= 65,500 gives int32 token files (Megatron's rule); same tokens as the uint16 run."""
    import lnstrain.data.preprocess as pre

    monkeypatch.setattr(pre, "token_dtype_for_vocab", lambda vocab_size: np.int32)  # as for a 65,500+ vocab
    prefix = str(tmp_path / "wide")
    preprocess(PreprocessConfig(inputs=[os.path.join(demo_corpus, "train.jsonl")], tokenizer=tokenizer_model,
                                output_prefix=prefix))
    dtype, seqs, _ = megatron_reader(prefix)
    assert dtype == "int32" and IndexedDataset(prefix).dtype == np.int32
    narrow = IndexedDataset(demo_prefix)
    assert seqs[:50] == [narrow[i].tolist() for i in range(50)]


def test_retraining_a_tokenizer_elsewhere_gives_the_same_bytes(tmp_path, demo_corpus, tokenizer_model):
    """The model holds no output path (sentencepiece records one): its checksum, which checkpoints
    and the depth study's archive compare, names the vocabulary, not where or when it was trained."""
    from lnstrain.data.tokenizer import file_sha256
    from lnstrain.data.tokenizer_training import train_tokenizer

    prefix = str(tmp_path / "elsewhere" / "other_name")
    train_tokenizer(TokenizerTrainingConfig(inputs=[], output_prefix=prefix, vocab_size=500, model_type="bpe"),
                    [os.path.join(demo_corpus, "train.jsonl")])
    assert file_sha256(prefix + ".model") == file_sha256(tokenizer_model)


def test_more_workers_than_cores_are_capped_with_a_note(tmp_path, demo_corpus, tokenizer_model, capsys,
                                                        monkeypatch):
    tool = load_tool("preprocess_data")
    monkeypatch.setattr(tool, "available_cores", lambda: 1)
    prefix = str(tmp_path / "capped")
    assert tool.main(["--input", os.path.join(demo_corpus, "valid.jsonl"), "--tokenizer", tokenizer_model,
                      "--output-prefix", prefix, "--workers", "64", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "--workers 64 is more than the 1 core(s) available; using 1" in err and "with 1 worker(s)" in err
    assert tool.main(["--input", "x", "--tokenizer", tokenizer_model, "--output-prefix", prefix, "--workers", "0"]) == 2
