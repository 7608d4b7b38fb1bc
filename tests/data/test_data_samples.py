"""Sample indices: packed windows against a brute-force reference, truncate-pad, determinism, caching,
blend proportions over windows, document splits, token-id checks, config validation, fingerprints."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from lnstrain.data import (CacheWaitTimeout, DataConfig, DataSource, IndexCache, IndexedDataset, Tokenizer,
                           build_train_valid_datasets, check_token_ids, data_fingerprint, file_fingerprint)
from lnstrain.data.sample_index import build_blend_index, build_packed_index, build_truncate_pad_index
from lnstrain.data.splits import split_documents


def _reference_packed(docs: list[np.ndarray], doc_order, seq_len: int, num_samples: int) -> list[np.ndarray]:
    stream = np.concatenate([docs[d] for d in doc_order])
    return [stream[j * seq_len: j * seq_len + seq_len + 1] for j in range(num_samples)]


@pytest.mark.parametrize("seq_len,num_samples", [(4, 20), (7, 3), (16, 40), (1, 50)])
def test_packed_index_matches_brute_force(seq_len, num_samples):
    rng = np.random.default_rng(seq_len)
    sizes = rng.integers(0, 9, 12).astype(np.int32)  # includes empty documents
    sizes[0] = 3
    docs = [np.arange(s) + 100 * d for d, s in enumerate(sizes)]
    doc_ids = np.array([0, 2, 3, 5, 7, 8, 11])
    index = build_packed_index(sizes, doc_ids, seq_len, num_samples, seed=5)
    order, sidx = index["doc_order"], index["sample_idx"]
    built = len(sidx) - 1  # samples of every epoch touched (>= num_samples); the first num_samples are served
    reference = _reference_packed(docs, order, seq_len, built)
    stream_docs = np.concatenate([np.full(sizes[d], d) for d in order])
    for j in range(built):
        (d0, o0), (d1, o1) = sidx[j], sidx[j + 1]
        got = np.concatenate([docs[order[d0]][o0:]] + [docs[order[d]] for d in range(d0 + 1, d1)]
                             + [docs[order[d1]][:o1 + 1]]) if d0 != d1 else docs[order[d0]][o0:o1 + 1]
        assert got.tolist() == reference[j].tolist()
    assert set(stream_docs.tolist()) <= set(doc_ids.tolist())
    # each epoch is a permutation of the selected documents
    epoch = len(doc_ids)
    for e in range(len(order) // epoch):
        assert sorted(order[e * epoch:(e + 1) * epoch].tolist()) == doc_ids.tolist()
    shuffle = index["shuffle_idx"]
    assert len(shuffle) == num_samples and len(set(shuffle.tolist())) == num_samples and shuffle.max() < built


def test_shuffle_stays_within_epochs():
    sizes = np.full(100, 10, np.int32)  # 1000 tokens per epoch, 100 samples of 10
    index = build_packed_index(sizes, np.arange(100), 10, 250, seed=1)
    shuffle = index["shuffle_idx"]
    assert sorted(shuffle[:100]) == list(range(100))  # epoch 1 served entirely before epoch 2
    assert sorted(shuffle[100:200]) == list(range(100, 200))
    assert shuffle[:100].tolist() != list(range(100))


def test_index_determinism_and_seed():
    sizes = np.arange(1, 200, dtype=np.int32)
    a = build_packed_index(sizes, np.arange(199), 32, 300, seed=7)
    b = build_packed_index(sizes, np.arange(199), 32, 300, seed=7)
    c = build_packed_index(sizes, np.arange(199), 32, 300, seed=8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["shuffle_idx"], c["shuffle_idx"])


@pytest.mark.parametrize("seq_len", [3, 16])
def test_longer_run_starts_with_the_shorter_runs_samples(seq_len):
    """Extending a run (more samples) keeps every sample already served: resume stays exact."""
    sizes = np.random.default_rng(seq_len).integers(1, 40, 50).astype(np.int32)
    docs = [np.arange(s) + 1000 * d for d, s in enumerate(sizes)]

    def served(num_samples: int) -> np.ndarray:
        index = build_packed_index(sizes, np.arange(50), seq_len, num_samples, seed=9)
        stream = np.concatenate([docs[d] for d in index["doc_order"]])
        return np.stack([stream[j * seq_len: j * seq_len + seq_len + 1] for j in index["shuffle_idx"]])

    long = served(700)
    for n in (1, 59, 333):
        assert np.array_equal(served(n), long[:n])
    blend = build_blend_index([0.5, 0.25, 0.25], 999)
    longer = build_blend_index([0.5, 0.25, 0.25], 5000)
    assert all(np.array_equal(blend[k], longer[k][:999]) for k in blend)


def test_truncate_pad_samples(demo_prefix, tokenizer_model, tmp_path):
    cfg = DataConfig(sources=[DataSource(demo_prefix)], seq_len=32, tokenizer=tokenizer_model, mode="truncate_pad",
                     valid_fraction=0.0, cache_dir=str(tmp_path))
    train, valid = build_train_valid_datasets(cfg, 3000, 0, seed=1, builds_cache=True)
    assert valid is None and len(train) == 3000
    ds = IndexedDataset(demo_prefix)
    order = build_truncate_pad_index(np.arange(len(ds)), 3000, seed=1)["doc_order"]
    assert sorted(order[:len(ds)].tolist()) == list(range(len(ds)))  # a full epoch before any repeat
    pad = Tokenizer(tokenizer_model).eos_id  # this tokenizer has no pad: padding uses EOS, masked out
    short = next(i for i in range(3000) if len(ds[order[i]]) < 33)
    long = next(i for i in range(3000) if len(ds[order[i]]) > 33)
    s = train[short]
    n = len(ds[order[short]])
    assert s["tokens"][:n].tolist() == ds[order[short]].tolist() and (s["tokens"][n:] == pad).all()
    assert s["loss_mask"].tolist() == [1.0] * (n - 1) + [0.0] * (33 - n)
    s = train[long]
    assert s["tokens"].tolist() == ds[order[long]][:33].tolist() and s["loss_mask"].all()


def test_blend_follows_weights_in_every_window():
    weights = [0.6, 0.3, 0.1]
    index = build_blend_index(weights, 20000)
    di = index["dataset_index"]
    for start in range(0, 20000, 100):
        counts = np.bincount(di[start:start + 100], minlength=3)
        assert np.all(np.abs(counts - 100 * np.array(weights)) <= 2), (start, counts)
    prefix_counts = np.cumsum(np.eye(3)[di], axis=0)
    expected = np.arange(1, 20001)[:, None] * np.array(weights)
    assert np.abs(prefix_counts - expected).max() <= 1.5
    # each dataset's samples are used in order, without gaps
    for k in range(3):
        assert index["dataset_sample_index"][di == k].tolist() == list(range(int((di == k).sum())))


def test_blended_datasets_draw_from_each_source(demo_prefix, copy_prefix, tokenizer_model, tmp_path):
    other = copy_prefix(demo_prefix, "other")
    cfg = DataConfig(sources=[DataSource(demo_prefix, 3.0), DataSource(other, 1.0)], seq_len=64,
                     tokenizer=tokenizer_model, cache_dir=str(tmp_path / "cache"))
    train, valid = build_train_valid_datasets(cfg, 4000, 40, seed=3, builds_cache=True)
    assert len(train) == 4000 and len(valid) == 40
    assert np.bincount(train.dataset_index).tolist() == [3000, 1000]
    for i in range(0, 4000, 397):
        k, j = train.dataset_index[i], train.dataset_sample_index[i]
        assert np.array_equal(train[i]["tokens"], train.datasets[k][int(j)]["tokens"])
    assert sorted(train.prefixes) == sorted([demo_prefix, other])


def test_split_by_documents_is_disjoint(demo_prefix, tokenizer_model, tmp_path):
    train_docs, valid_docs = split_documents(1000, 0.05, 1234)
    assert len(valid_docs) == 50 and not set(train_docs) & set(valid_docs)
    assert sorted(np.concatenate([train_docs, valid_docs]).tolist()) == list(range(1000))
    cfg = DataConfig(sources=[DataSource(demo_prefix)], seq_len=64, valid_fraction=0.1, cache_dir=str(tmp_path))
    n = IndexedDataset(demo_prefix).num_documents
    train, valid = build_train_valid_datasets(cfg, 14000, 2000, seed=1, builds_cache=True)  # > 1 epoch each
    train_set, valid_set = set(train.doc_order.tolist()), set(valid.doc_order.tolist())
    expected_train, expected_valid = split_documents(n, 0.1, cfg.split_seed)
    assert not train_set & valid_set
    assert valid_set == set(expected_valid.tolist()) and len(valid_set) == round(0.1 * n)
    assert train_set == set(expected_train.tolist())


def test_a_validation_split_too_small_for_the_evaluation_is_named_with_its_repetition(demo_prefix, tmp_path,
                                                                                        caplog):
    """A few held-out documents repeated to fill the evaluation: a warning naming the count and the fix."""
    cfg = DataConfig(sources=[DataSource(demo_prefix)], seq_len=64, valid_fraction=0.002, cache_dir=str(tmp_path))
    sequences = IndexedDataset(demo_prefix).sizes
    _, held_out = split_documents(len(sequences), 0.002, cfg.split_seed)
    distinct = int(sequences[held_out].sum()) // 64
    with caplog.at_level("WARNING", logger="lnstrain.data.builder"):
        build_train_valid_datasets(cfg, 100, distinct, seed=1, builds_cache=True)  # exactly enough: silent
        assert not caplog.records
        build_train_valid_datasets(cfg, 100, 20 * distinct, seed=1, builds_cache=True)
        build_train_valid_datasets(cfg, 100, 20 * distinct, seed=1, builds_cache=False)  # only the building rank warns
    (record,) = caplog.records
    assert (f"the validation split is {len(held_out)} documents of" in record.message
            and f"{distinct} distinct samples of data.seq_len 64" in record.message
            and "served about 20 times" in record.message)
    assert "data.valid_fraction: 0.04" in record.message and "data.valid_sources" in record.message


def test_a_validation_file_shorter_than_one_sample_says_so_and_not_how_often_each_is_served(
        megatron_writer, tmp_path, caplog):
    """9 tokens against data.seq_len 16: no distinct sample at all, every one the same tokens again."""
    megatron_writer(str(tmp_path / "valid"), [[list(range(3, 12))]])
    megatron_writer(str(tmp_path / "train"), [[list(range(3, 40))]] * 20)
    cfg = DataConfig(sources=[DataSource(str(tmp_path / "train"))], valid_sources=[DataSource(str(tmp_path / "valid"))],
                     seq_len=16, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="lnstrain.data.builder"):
        _, valid = build_train_valid_datasets(cfg, 10, 32, seed=1, builds_cache=True)
    (record,) = caplog.records
    assert record.message.startswith("the validation split is 1 document of 9 tokens in all, less than one sample "
                                     "of data.seq_len 16, but an evaluation reads 32 samples"), record.message
    assert "0 distinct" not in record.message and "served about" not in record.message
    assert "give larger validation files (data.valid_sources)" in record.message
    assert set(valid[0]["tokens"].tolist()) <= set(range(3, 12))  # what it says: those tokens again


def test_cache_reused_and_rebuilt_when_inputs_change(demo_prefix, copy_prefix, demo_token_docs,
                                                     megatron_writer, tmp_path):
    prefix = copy_prefix(demo_prefix)
    cache_dir = tmp_path / "cache"
    cfg = DataConfig(sources=[DataSource(prefix)], seq_len=64, valid_fraction=0.0, cache_dir=str(cache_dir))
    a, _ = build_train_valid_datasets(cfg, 500, 0, seed=1, builds_cache=True)
    files = sorted(os.listdir(cache_dir))
    mtimes = {f: os.stat(cache_dir / f).st_mtime_ns for f in files}
    b, _ = build_train_valid_datasets(cfg, 500, 0, seed=1, builds_cache=False)  # waits for nothing: reuses
    assert sorted(os.listdir(cache_dir)) == files
    assert mtimes == {f: os.stat(cache_dir / f).st_mtime_ns for f in files}
    assert all(np.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(0, 500, 50))
    fingerprint = data_fingerprint(cfg)
    megatron_writer(prefix, [[d] for d in demo_token_docs[:-1]])  # the data changes under the same name
    assert data_fingerprint(cfg) != fingerprint
    build_train_valid_datasets(cfg, 500, 0, seed=1, builds_cache=True)
    assert len(os.listdir(cache_dir)) == 2 * len(files)
    build_train_valid_datasets(DataConfig(**{**cfg.__dict__, "seq_len": 32}), 500, 0, seed=1, builds_cache=True)
    assert len(os.listdir(cache_dir)) == 3 * len(files)


def test_waiting_rank_times_out_clearly(tmp_path):
    cache = IndexCache(str(tmp_path), builds=False, timeout_s=0.3, poll_s=0.05)
    with pytest.raises(CacheWaitTimeout, match=r"timed out after 0s waiting for .*never\.json.*rank 0"):
        cache.get_or_build("never", {}, lambda: {"x": np.zeros(1)}, lambda arrays: None)


@pytest.mark.parametrize("header", [{"descr": "<i4", "fortran_order": False, "shape": (2**40, 2**40)},
                                    {"descr": "|O", "fortran_order": False, "shape": (3,)},
                                    {"descr": "<i4", "fortran_order": False, "shape": (10**6,)}])
def test_a_made_up_array_header_is_named_and_rebuilt(tmp_path, caplog, header):
    import io

    def build():
        return {"x": np.arange(5)}

    IndexCache(str(tmp_path), builds=True).get_or_build("entry", {}, build, lambda arrays: None)
    made_up = io.BytesIO()
    np.lib.format.write_array_header_1_0(made_up, header)
    (tmp_path / "entry.x.npy").write_bytes(made_up.getvalue() + bytes(40))
    arrays = IndexCache(str(tmp_path), builds=True).get_or_build("entry", {}, build, lambda arrays: None)
    assert "not using the cached index" in caplog.text and "an array cannot be read" in caplog.text
    assert arrays["x"].tolist() == list(range(5))


def test_check_token_ids(tmp_path, demo_token_docs, megatron_writer, demo_prefix):
    check_token_ids([demo_prefix], 500)
    with pytest.raises(ValueError, match=r"demo_train\.bin holds token id 499, outside .*\[0, 499\)"):
        check_token_ids([demo_prefix], 499)
    prefix = str(tmp_path / "neg")
    megatron_writer(prefix, [[[3, -7, 2]]], "int32")
    with pytest.raises(ValueError, match=r"neg\.bin holds token id -7"):
        check_token_ids(prefix, 500)
    assert os.path.isfile(prefix + ".idx.lnstrain-range.json")  # cached: the next check does not rescan


def test_training_start_catches_out_of_vocab_ids(demo_prefix, copy_prefix, megatron_writer, tokenizer_model,
                                                 tmp_path):
    prefix = str(tmp_path / "big")
    megatron_writer(prefix, [[[5, 6, 7, 900]], [[1, 2]]])  # id 900 >= the tokenizer's 500
    cfg = DataConfig(sources=[DataSource(prefix)], seq_len=2, tokenizer=tokenizer_model, valid_fraction=0.0)
    with pytest.raises(ValueError, match="big.bin holds token id 900"):
        build_train_valid_datasets(cfg, 3, 0, seed=0, builds_cache=True)


def test_config_validation_names_keys(tmp_path, demo_prefix):
    cfg = DataConfig(sources=[DataSource(str(tmp_path / "missing"), 0.0), DataSource(demo_prefix + ".bin")],
                     seq_len=0, mode="packd", valid_fraction=1.5, tokenizer=str(tmp_path / "t.model"))
    problems = "\n".join(cfg.validate())
    for text in ["data.seq_len must be > 0 (got 0)", "data.mode must be one of packed, truncate_pad",
                 "data.valid_fraction", "data.sources[0].prefix: missing", "missing.bin",
                 "data.sources[0].weight must be a finite number > 0", "data.sources[1].prefix should not end",
                 "data.tokenizer: file not found"]:
        assert text in problems
    assert DataConfig(sources=[DataSource(demo_prefix)]).validate() == []
    assert "data.sources is empty" in DataConfig().validate()[0]
    with pytest.raises(ValueError, match="data.seq_len"):
        build_train_valid_datasets(cfg, 10, 0, seed=0, builds_cache=True)


def test_fingerprint_follows_content_not_path(demo_prefix, copy_prefix, tmp_path):
    copy = copy_prefix(demo_prefix, "elsewhere")
    assert file_fingerprint(copy) == file_fingerprint(demo_prefix)
    with open(copy + ".bin", "r+b") as f:
        f.seek(10)
        f.write(b"\x07\x00")
    assert file_fingerprint(copy) != file_fingerprint(demo_prefix)
    shutil.rmtree(tmp_path)


def test_empty_source_error_names_the_file(tmp_path, megatron_writer):
    prefix = str(tmp_path / "hollow")
    megatron_writer(prefix, [[[]], [[]]])  # two documents without tokens
    cfg = DataConfig(sources=[DataSource(prefix)], seq_len=8, valid_fraction=0.0, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"hollow \(train split, 2 sequences\): .*hold no tokens"):
        build_train_valid_datasets(cfg, 4, 0, seed=0, builds_cache=True)
