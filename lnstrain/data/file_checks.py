"""The token files a run names, checked before anything starts: every ``.idx``/``.bin`` pair opens
(header, sizes, pointers, document index and ``.bin`` length agree) and every token id fits the
model's and the tokenizer's vocabularies.

Every rank may run this (the launcher does, before any process group exists): opening a pair reads
its index, and the token-id range is read from the cache beside the ``.idx`` once rank 0 or an
earlier launch has scanned the ``.bin`` (``token_check.token_id_range``).
"""
from __future__ import annotations

import os

from .config import DataConfig
from .indexed_dataset import IndexedDataset
from .token_check import out_of_range_id

_REPROCESS = "re-run tools/preprocess_data.py to rewrite the pair"


def token_file_problems(cfg: DataConfig, model_vocab_size: int, tokenizer_vocab_size: int | None) -> list[str]:
    """One line per unreadable pair or out-of-range token id, naming the config key and the file.

    Missing files are left to ``DataConfig.file_problems``; ``tokenizer_vocab_size`` is None when
    there is no readable tokenizer.
    """
    problems: list[str] = []
    checked: set[str] = set()
    for key, i, source in cfg._keyed_sources():
        prefix = source.prefix
        if prefix in checked or not all(os.path.isfile(prefix + ext) for ext in (".idx", ".bin")):
            continue
        checked.add(prefix)
        where = f"{key}[{i}].prefix"
        try:
            IndexedDataset(prefix)
            too_big_for_model = out_of_range_id(prefix, model_vocab_size)
            too_big_for_tokenizer = (out_of_range_id(prefix, tokenizer_vocab_size)
                                     if tokenizer_vocab_size is not None else None)
        except (OSError, ValueError) as error:  # CorruptDatasetError is a ValueError
            problems.append(f"{where}: {error}; {_REPROCESS}")
            continue
        if too_big_for_model is not None and too_big_for_tokenizer is None and tokenizer_vocab_size is not None:
            # a piece of data.tokenizer: the model's vocabulary is what is too small (the tokenizer check says so)
            problems.append(f"{where}: {prefix}.bin holds token id {too_big_for_model}, a piece of data.tokenizer "
                            f"({tokenizer_vocab_size} pieces) but outside model.vocab_size ({model_vocab_size}): "
                            f"set model.vocab_size to {tokenizer_vocab_size}")
        elif too_big_for_model is not None:
            problems.append(f"{where}: {prefix}.bin holds token id {too_big_for_model}, outside model.vocab_size "
                            f"({model_vocab_size}); the data was tokenized with another tokenizer, or the "
                            f"file is corrupt: {_REPROCESS} with data.tokenizer, or set model.vocab_size to the "
                            "tokenizer's vocabulary size")
        elif too_big_for_tokenizer is not None:
            problems.append(f"{where}: {prefix}.bin holds token id {too_big_for_tokenizer}, but data.tokenizer "
                            f"has {tokenizer_vocab_size} pieces; the data was tokenized with another tokenizer: "
                            f"{_REPROCESS} with data.tokenizer, or point data.tokenizer at the one it was made with")
    return problems
