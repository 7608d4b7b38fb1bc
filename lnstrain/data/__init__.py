"""lnstrain data path: raw corpus -> tokenizer -> Megatron token files -> packed, blended, split samples -> batches.

Public API (see docs/data.md):
    DataConfig, DataSource                  configuration (config.py)
    Tokenizer                               sentencepiece wrapper (tokenizer.py)
    IndexedDataset, IndexedDatasetWriter,   Megatron-format reader / writer / merge (indexed_*.py)
    merge_datasets
    build_train_valid_datasets              DataConfig -> (train, valid) sample datasets (builder.py)
    CheckRecords                            one check of a cached index per node and launch (check_records.py)
    iterate_micro_batches, collate          per-data-parallel-rank micro-batches (batches.py)
    data_fingerprint, file_fingerprint      content hashes for checkpoints and caches (fingerprint.py)
    check_token_ids                         token ids vs. vocabulary (token_check.py)
"""
from .batches import collate, iterate_micro_batches
from .blended_dataset import BlendedDataset
from .builder import build_train_valid_datasets
from .check_records import CheckRecords
from .config import DataConfig, DataSource
from .fingerprint import data_fingerprint, file_fingerprint
from .index_cache import CacheWaitTimeout, IndexCache
from .indexed_dataset import CorruptDatasetError, IndexedDataset
from .indexed_writer import IndexedDatasetWriter, merge_datasets
from .packed_dataset import PackedDataset, TruncatePadDataset
from .token_check import check_token_ids
from .tokenizer import Tokenizer

__all__ = [
    "BlendedDataset", "CacheWaitTimeout", "CheckRecords", "CorruptDatasetError", "DataConfig", "DataSource",
    "IndexCache", "IndexedDataset", "IndexedDatasetWriter", "PackedDataset", "Tokenizer", "TruncatePadDataset",
    "build_train_valid_datasets", "check_token_ids", "collate", "data_fingerprint", "file_fingerprint",
    "iterate_micro_batches", "merge_datasets",
]
