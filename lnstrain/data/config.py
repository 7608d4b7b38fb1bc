"""Configuration of the data path: which token files, how they are blended, split and cut into samples."""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

MODES = ("packed", "truncate_pad")


@dataclass
class DataSource:
    """One tokenized corpus (``<prefix>.bin`` + ``<prefix>.idx``) and its share of the blend.

    Fields:
        prefix: path prefix of the Megatron-format token files (without ``.bin``/``.idx``).
        weight: relative sampling weight; weights of a blend are normalised to sum to 1.
    """

    prefix: str
    weight: float = 1.0


@dataclass
class DataConfig:
    """Where the training data comes from and how it is turned into samples.

    Fields:
        sources: the training blend (one or more token files with weights).
        valid_sources: validation blend; if empty, ``valid_fraction`` of the documents of each
            training source are held out instead (a document is never in both splits).
        valid_fraction: fraction of documents held out for validation when ``valid_sources`` is empty
            (0 disables validation).
        seq_len: tokens per training sample; each sample holds ``seq_len + 1`` tokens (inputs + shifted labels).
        tokenizer: path to the sentencepiece ``.model`` the data was tokenized with (used for the pad id,
            the vocabulary check and the checkpoint's tokenizer checksum).
        mode: ``"packed"`` (GPT-style windows across document boundaries) or ``"truncate_pad"``
            (one document per sample, truncated to ``seq_len + 1`` tokens and padded, padding masked out).
        cache_dir: where the sample-index cache files go; default: a ``lnstrain_cache`` folder beside
            the first source's data.
        split_seed: seed of the train/validation document split (kept apart from the training seed so
            that changing the shuffle never moves documents between splits).
        cache_wait_timeout_s: how long ranks that do not build the cache wait for it before failing.
    """

    sources: list[DataSource] = field(default_factory=list)
    valid_sources: list[DataSource] = field(default_factory=list)
    valid_fraction: float = 0.01
    seq_len: int = 256
    tokenizer: str = ""
    mode: str = "packed"
    cache_dir: str | None = None
    split_seed: int = 1234
    cache_wait_timeout_s: float = 7200.0

    def validate(self, check_files: bool = True) -> list[str]:
        """Return every problem found, each naming the config key and how to fix it (empty when valid).

        ``check_files=False`` leaves out ``file_problems()``, for planning a run before its data exists.
        """
        problems: list[str] = []
        if self.seq_len <= 0:
            problems.append(f"data.seq_len must be > 0 (got {self.seq_len})")
        if self.mode not in MODES:
            problems.append(f"data.mode must be one of {', '.join(MODES)} (got {self.mode!r})")
        if not 0.0 <= self.valid_fraction < 1.0:
            problems.append(f"data.valid_fraction must be in [0, 1) (got {self.valid_fraction})")
        if self.cache_wait_timeout_s <= 0:
            problems.append(f"data.cache_wait_timeout_s must be > 0 (got {self.cache_wait_timeout_s})")
        if not self.sources:
            problems.append("data.sources is empty: list at least one {prefix: path/to/data, weight: 1.0}")
        for key, i, src in self._keyed_sources():
            problems.extend(_source_problems(f"{key}[{i}]", src))
        return problems + (self.file_problems() if check_files else [])

    def file_problems(self) -> list[str]:
        """Token files and tokenizer that do not exist (yet)."""
        problems = []
        for key, i, src in self._keyed_sources():
            if src.prefix and not src.prefix.endswith((".bin", ".idx")):
                missing = [src.prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(src.prefix + ext)]
                if missing:
                    problems.append(f"{key}[{i}].prefix: missing {', '.join(missing)} "
                                    f"(create them with tools/preprocess_data.py)")
        if self.tokenizer and not os.path.isfile(self.tokenizer):
            problems.append(f"data.tokenizer: file not found: {self.tokenizer} (train one with "
                            "tools/train_tokenizer.py or point to an existing sentencepiece .model)")
        return problems

    def _keyed_sources(self) -> Iterator[tuple[str, int, DataSource]]:
        for key, sources in (("data.sources", self.sources), ("data.valid_sources", self.valid_sources)):
            for i, src in enumerate(sources):
                yield key, i, src


def _source_problems(key: str, src: DataSource) -> list[str]:
    problems = []
    if not src.prefix:
        problems.append(f"{key}.prefix is empty")
        return problems
    if src.prefix.endswith((".bin", ".idx")):
        problems.append(f"{key}.prefix should not end in .bin/.idx (got {src.prefix!r}; "
                        f"use {src.prefix[:-4]!r})")
    if not (isinstance(src.weight, (int, float)) and math.isfinite(src.weight) and src.weight > 0):
        problems.append(f"{key}.weight must be a finite number > 0 (got {src.weight})")
    return problems
