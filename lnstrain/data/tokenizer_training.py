"""Train a sentencepiece tokenizer from a bounded, uniform sample of a (possibly huge) corpus."""
from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Iterator

import sentencepiece as spm

from .corpus_readers import SkipCounts, check_inputs, iter_documents

logger = logging.getLogger(__name__)


@dataclass
class TokenizerTrainingConfig:
    """Options of tools/train_tokenizer.py (see its --help for each)."""

    inputs: list[str]
    output_prefix: str
    vocab_size: int = 32000
    model_type: str = "bpe"
    json_keys: list[str] = field(default_factory=lambda: ["text"])  # JSON keys, or columns of Parquet/Arrow inputs
    txt_mode: str = "line"
    max_sentences: int = 2_000_000
    max_sentence_chars: int = 4192
    max_read_mb: float = 0.0
    byte_fallback: bool = True
    character_coverage: float = 0.9995
    normalization: str = "identity"
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    user_defined_symbols: list[str] = field(default_factory=list)
    seed: int = 0
    num_threads: int = 0


@dataclass
class TokenizerTrainingReport:
    documents_read: int
    sentences_seen: int
    sentences_sampled: int
    mb_read: float
    skips: SkipCounts
    sample_seconds: float
    train_seconds: float
    model_path: str
    vocab_path: str


def _sentences(docs: Iterator[str], max_chars: int) -> Iterator[str]:
    for doc in docs:
        for line in doc.split("\n"):
            line = line.strip()
            if line:
                yield line[:max_chars]


def reservoir_sample(cfg: TokenizerTrainingConfig, paths: list[str]) -> tuple[list[str], dict]:
    """Uniform sample of at most ``max_sentences`` sentences (Algorithm R): memory bounded by the sample."""
    rng = random.Random(cfg.seed)
    skips = SkipCounts()
    sample: list[str] = []
    stats = {"documents": 0, "sentences": 0, "bytes": 0}
    limit = cfg.max_read_mb * 1e6 if cfg.max_read_mb > 0 else float("inf")

    def counted_docs() -> Iterator[str]:
        for doc in iter_documents(paths, cfg.json_keys, cfg.txt_mode, skips):
            stats["documents"] += 1
            stats["bytes"] += len(doc)
            yield doc
            if stats["bytes"] >= limit:
                return

    for n, sentence in enumerate(_sentences(counted_docs(), cfg.max_sentence_chars)):
        if n < cfg.max_sentences:
            sample.append(sentence)
        else:
            j = rng.randint(0, n)
            if j < cfg.max_sentences:
                sample[j] = sentence
        stats["sentences"] = n + 1
    stats["skips"] = skips
    return sample, stats


def _forget_model_prefix(model_path: str) -> None:
    """Clear the output path sentencepiece records in the model (here a temporary name with a process
    id), so that the same sample and settings give the same bytes, and so the same checksum, wherever
    and whenever they are trained."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as handle:
        proto.ParseFromString(handle.read())
    proto.trainer_spec.ClearField("model_prefix")
    with open(model_path, "wb") as handle:
        handle.write(proto.SerializeToString())


def train_tokenizer(cfg: TokenizerTrainingConfig, paths: list[str]) -> TokenizerTrainingReport:
    """Sample sentences, train, and write ``<output_prefix>.model``/``.vocab`` (atomically renamed)."""
    if cfg.model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram' (got {cfg.model_type!r})")
    check_inputs(paths, cfg.json_keys)
    t0 = time.perf_counter()
    sample, stats = reservoir_sample(cfg, paths)
    if not sample:
        raise ValueError(f"no usable text found in {len(paths)} input file(s) "
                         f"(--json-keys {' '.join(cfg.json_keys)}; skipped: {stats['skips'].report()})")
    t1 = time.perf_counter()
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{cfg.output_prefix}.tmp-{os.getpid()}"
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(sample), model_prefix=tmp_prefix, vocab_size=cfg.vocab_size,
            model_type=cfg.model_type, byte_fallback=cfg.byte_fallback,
            character_coverage=cfg.character_coverage, unk_id=cfg.unk_id, bos_id=cfg.bos_id,
            eos_id=cfg.eos_id, pad_id=cfg.pad_id, user_defined_symbols=cfg.user_defined_symbols,
            input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=cfg.max_sentence_chars * 4,
            num_threads=cfg.num_threads or os.cpu_count() or 1, split_digits=True,
            allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
            normalization_rule_name=cfg.normalization, minloglevel=2)
    except RuntimeError as e:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
        raise ValueError(f"sentencepiece training failed: {e}") from e
    _forget_model_prefix(tmp_prefix + ".model")
    for ext in (".model", ".vocab"):
        os.replace(tmp_prefix + ext, cfg.output_prefix + ext)
    t2 = time.perf_counter()
    return TokenizerTrainingReport(
        documents_read=stats["documents"], sentences_seen=stats["sentences"], sentences_sampled=len(sample),
        mb_read=stats["bytes"] / 1e6, skips=stats["skips"], sample_seconds=t1 - t0, train_seconds=t2 - t1,
        model_path=cfg.output_prefix + ".model", vocab_path=cfg.output_prefix + ".vocab")
