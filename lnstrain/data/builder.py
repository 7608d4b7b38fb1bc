"""Entry point used by training: DataConfig -> (train dataset, validation dataset)."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from .blended_dataset import BlendedDataset, blend_counts
from .check_records import CheckRecords
from .config import DataConfig, DataSource
from .fingerprint import file_fingerprint
from .index_cache import IndexCache
from .indexed_dataset import IndexedDataset
from .packed_dataset import PackedDataset, TruncatePadDataset, build_sample_dataset
from .splits import documents_to_sequences, split_documents
from .token_check import check_token_ids
from .tokenizer import Tokenizer
from lnstrain.wording import counted

logger = logging.getLogger(__name__)

SampleDataset = PackedDataset | TruncatePadDataset | BlendedDataset


@dataclass
class _Part:
    """One component of a blend: a token file, the sequences it may use, and its weight."""

    indexed: IndexedDataset
    sequences: np.ndarray
    weight: float


def default_cache_dir(cfg: DataConfig) -> str:
    return cfg.cache_dir or os.path.join(os.path.dirname(os.path.abspath(cfg.sources[0].prefix)), "lnstrain_cache")


def _pad_id(cfg: DataConfig) -> int:
    if not cfg.tokenizer:
        return 0
    tok = Tokenizer(cfg.tokenizer)
    return next((i for i in (tok.pad_id, tok.eos_id) if i >= 0), 0)


def _split_parts(cfg: DataConfig) -> tuple[list[_Part], list[_Part]]:
    def whole(src: DataSource) -> _Part:
        ds = IndexedDataset(src.prefix)
        return _Part(ds, np.arange(len(ds), dtype=np.int64), src.weight)

    if cfg.valid_sources or cfg.valid_fraction == 0:
        return [whole(s) for s in cfg.sources], [whole(s) for s in cfg.valid_sources]
    train, valid = [], []
    for src in cfg.sources:
        ds = IndexedDataset(src.prefix)
        train_docs, valid_docs = split_documents(ds.num_documents, cfg.valid_fraction, cfg.split_seed)
        train.append(_Part(ds, documents_to_sequences(ds.doc_idx, train_docs), src.weight))
        valid.append(_Part(ds, documents_to_sequences(ds.doc_idx, valid_docs), src.weight))
    return train, valid


def _build_blend(parts: list[_Part], cfg: DataConfig, num_samples: int, seed: int, cache: IndexCache,
                 pad_id: int, split: str) -> SampleDataset:
    def component(part: _Part, n: int, k: int):
        return build_sample_dataset(part.indexed, part.sequences, mode=cfg.mode, seq_len=cfg.seq_len,
                                    num_samples=n, seed=seed + k, cache=cache, pad_id=pad_id, split=split)

    if len(parts) == 1:
        return component(parts[0], num_samples, 0)
    fingerprints = [file_fingerprint(p.indexed.prefix) for p in parts]
    index, counts = blend_counts([p.weight for p in parts], num_samples, cache, fingerprints, split)
    datasets = [component(p, n, k) if n > 0 else None for k, (p, n) in enumerate(zip(parts, counts))]
    return BlendedDataset(datasets, [p.weight for p in parts], index)


def distinct_samples(parts: list[_Part], cfg: DataConfig) -> tuple[int, int, int]:
    """(sequences, tokens, distinct samples) of ``parts``: packed windows of ``seq_len`` tokens, or one
    sample per sequence in truncate_pad mode; a split asking for more serves some again."""
    sequences = sum(len(p.sequences) for p in parts)
    tokens = sum(int(p.indexed.sizes[p.sequences].sum(dtype=np.int64)) for p in parts)
    return sequences, tokens, tokens // cfg.seq_len if cfg.mode == "packed" else sequences


def validation_repeats_warning(parts: list[_Part], cfg: DataConfig, valid_samples: int) -> str | None:
    """A warning when the validation split is too small for ``valid_samples`` distinct samples: its
    text is then served several times per evaluation, and the eval loss measures little."""
    sequences, tokens, distinct = distinct_samples(parts, cfg)
    if distinct >= valid_samples:
        return None
    reads = (f"an evaluation reads {counted(valid_samples, 'sample')} (train.eval_batches x "
             "train.global_batch_size)")
    if cfg.valid_sources:
        fix = "give larger validation files (data.valid_sources)"
    else:
        repeats = valid_samples / max(distinct, 1)
        fraction = min(0.5, math.ceil(cfg.valid_fraction * repeats * 100) / 100)
        fix = (f"hold out more (data.valid_fraction: {fraction:g}) or give separate validation files "
               "(data.valid_sources)")
    split = f"the validation split is {counted(sequences, 'document')} of {counted(tokens, 'token')} in all"
    if distinct == 0:  # not one sample's worth: every sample is the same few tokens again
        return (f"{split}, less than one sample of data.seq_len {cfg.seq_len}, but {reads}: each sample repeats "
                f"those {counted(tokens, 'token')} over and over, so the eval loss says little and can fall below "
                f"the training loss; {fix}")
    repeats = valid_samples / distinct
    times = f"{repeats:.1f}" if repeats < 10 else f"{repeats:.0f}"
    return (f"{split}, {counted(distinct, 'distinct sample')} of data.seq_len {cfg.seq_len}, but {reads}: each is "
            f"served about {times} times, so the eval loss says little and can fall below the training loss; "
            f"{fix}, or lower train.eval_batches")


def build_train_valid_datasets(cfg: DataConfig, train_samples: int, valid_samples: int, seed: int,
                               builds_cache: bool, check_records: CheckRecords | None = None,
                               ) -> tuple[SampleDataset, SampleDataset | None]:
    """Training and validation datasets (validation is None when ``valid_samples == 0`` or nothing is held out).

    Call on every rank; ``builds_cache=True`` on exactly one (global rank 0): it builds missing index files
    (and checks token ids against the tokenizer's vocabulary), the others wait for those files. Every rank
    uses only index files that were checked; with ``check_records`` (``CheckRecords.for_this_node()``) one
    check per node serves the ranks of that node.
    Each dataset has ``len()`` and ``ds[i] -> {"tokens": int64[seq_len+1], "loss_mask": float32[seq_len]}``.
    """
    problems = cfg.validate()
    if problems:
        raise ValueError("invalid data config:\n  " + "\n  ".join(problems))
    if train_samples <= 0:
        raise ValueError(f"train_samples must be > 0 (got {train_samples})")
    cache = IndexCache(default_cache_dir(cfg), builds_cache, cfg.cache_wait_timeout_s, records=check_records)
    pad_id = _pad_id(cfg)
    train_parts, valid_parts = _split_parts(cfg)
    if builds_cache and cfg.tokenizer:
        check_token_ids([p.indexed.prefix for p in train_parts + valid_parts], Tokenizer(cfg.tokenizer).vocab_size)
    train = _build_blend(train_parts, cfg, train_samples, seed, cache, pad_id, "train")
    valid = None
    if valid_samples > 0 and valid_parts:
        valid = _build_blend(valid_parts, cfg, valid_samples, seed, cache, pad_id, "valid")
        repeats = validation_repeats_warning(valid_parts, cfg, valid_samples) if builds_cache else None
        if repeats:
            logger.warning(repeats)
    elif valid_samples > 0:
        logger.warning("valid_samples=%d requested but no validation data (data.valid_fraction is 0 and "
                       "data.valid_sources is empty)", valid_samples)
    logger.info("data: %d train samples%s from %d source(s), mode %s, seq_len %d, cache %s", len(train),
                f", {len(valid)} valid samples" if valid is not None else "", len(cfg.sources), cfg.mode,
                cfg.seq_len, cache.directory)
    return train, valid
