"""Per-data-parallel-rank batches: exact resume at a different data-parallel size, slices, errors, and
one cache builder with waiting ranks in separate spawned processes."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lnstrain.data import DataConfig, DataSource, build_train_valid_datasets, iterate_micro_batches

GB, MB = 24, 2


class _Recorder:
    """A dataset proxy that records which samples were read."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self.read.append(i)
        return self.dataset[i]


def _global_batches(dataset, consumed: int, dp_size: int, num: int | None = None) -> list[torch.Tensor]:
    """Global batches assembled from every rank's micro-batches (rank order), starting at ``consumed``."""
    per_rank = [list(iterate_micro_batches(dataset, consumed, GB, MB, r, dp_size)) for r in range(dp_size)]
    steps = len(per_rank[0]) // (GB // (MB * dp_size))
    out = []
    for g in range(steps if num is None else num):
        k = GB // (MB * dp_size)
        out.append(torch.cat([mb["tokens"] for r in range(dp_size) for mb in per_rank[r][g * k:(g + 1) * k]]))
    return out


@pytest.fixture
def blend_cfg(demo_prefix, copy_prefix, tokenizer_model, tmp_path):
    other = copy_prefix(demo_prefix, "other")
    return DataConfig(sources=[DataSource(demo_prefix, 2.0), DataSource(other, 1.0)], seq_len=48,
                      tokenizer=tokenizer_model, valid_fraction=0.02, cache_dir=str(tmp_path / "cache"))


def test_resume_at_other_dp_size_gives_identical_batches(blend_cfg):
    train, _ = build_train_valid_datasets(blend_cfg, 10 * GB, 0, seed=11, builds_cache=True)
    reference = _global_batches(train, 0, dp_size=1)
    assert len(reference) == 10
    assert reference[0].shape == (GB, 49) and reference[0].dtype == torch.int64
    first = _global_batches(train, 0, dp_size=4, num=3)  # interrupted after 3 steps at dp=4
    restarted, _ = build_train_valid_datasets(blend_cfg, 10 * GB, 0, seed=11, builds_cache=False)
    rest = _global_batches(restarted, 3 * GB, dp_size=3)  # resumed at dp=3 in a "new process"
    resumed = first + rest
    assert len(resumed) == 10
    assert all(torch.equal(a, b) for a, b in zip(reference, resumed))
    other_seed, _ = build_train_valid_datasets(blend_cfg, 10 * GB, 0, seed=12, builds_cache=True)
    assert not torch.equal(_global_batches(other_seed, 0, 1, num=1)[0], reference[0])


def test_each_rank_reads_only_its_slice(blend_cfg):
    train, _ = build_train_valid_datasets(blend_cfg, 6 * GB, 0, seed=1, builds_cache=True)
    dp = 3
    for rank in range(dp):
        rec = _Recorder(train)
        batches = list(iterate_micro_batches(rec, 2 * GB, GB, MB, rank, dp))
        assert len(batches) == 4 * (GB // (MB * dp))
        expected = [g * GB + rank * (GB // dp) + j for g in range(2, 6) for j in range(GB // dp)]
        assert rec.read == expected
        mb = batches[0]
        assert set(mb) == {"tokens", "loss_mask"}
        assert mb["tokens"].shape == (MB, 49) and mb["loss_mask"].shape == (MB, 48)
        assert mb["loss_mask"].dtype == torch.float32


def test_batch_size_errors(blend_cfg):
    train, _ = build_train_valid_datasets(blend_cfg, 2 * GB, 0, seed=1, builds_cache=True)
    with pytest.raises(ValueError, match=r"global_batch_size \(24\) must be divisible by micro_batch_size \(5\).* = 10"):
        next(iterate_micro_batches(train, 0, GB, 5, 0, 2))
    with pytest.raises(ValueError, match="multiple of global_batch_size"):
        next(iterate_micro_batches(train, 5, GB, MB, 0, 2))
    with pytest.raises(ValueError, match="dp_rank"):
        next(iterate_micro_batches(train, 0, GB, MB, 2, 2))


def test_truncate_pad_batches_carry_the_mask(blend_cfg):
    blend_cfg.mode = "truncate_pad"
    train, valid = build_train_valid_datasets(blend_cfg, 2 * GB, GB, seed=1, builds_cache=True)
    batches = list(iterate_micro_batches(train, 0, GB, MB, 0, 1))
    masks = torch.cat([b["loss_mask"] for b in batches])
    assert masks.shape == (2 * GB, 48) and 0 < masks.mean() < 1  # some documents are shorter than 49 tokens
    assert len(list(iterate_micro_batches(valid, 0, GB, MB, 0, 1))) == GB // MB


def _rank_fn(rank: int, world_size: int, cfg: DataConfig) -> list[np.ndarray]:
    if rank == 0:
        time.sleep(1.0)  # the others start first and must wait for the files, not build them
    train, _ = build_train_valid_datasets(cfg, 8 * GB, 0, seed=5, builds_cache=(rank == 0))
    return [mb["tokens"].numpy() for mb in iterate_micro_batches(train, 0, GB, MB, rank, world_size)]


@pytest.mark.multirank
def test_one_rank_builds_cache_others_wait(blend_cfg):
    from lnstrain.testing.distributed import run_distributed

    results = run_distributed(_rank_fn, 2, blend_cfg, timeout_s=120)
    train, _ = build_train_valid_datasets(blend_cfg, 8 * GB, 0, seed=5, builds_cache=False)  # reuses their cache
    per_rank = GB // 2 // MB
    for g in range(8):
        got = np.concatenate([np.concatenate(results[r][g * per_rank:(g + 1) * per_rank]) for r in range(2)])
        assert np.array_equal(got, np.stack([train[i]["tokens"] for i in range(g * GB, (g + 1) * GB)]))
