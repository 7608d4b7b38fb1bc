"""A tiny real-looking corpus, tokenizer and token files for tests and smoke runs (seconds to build).

The text is generated from a small grammar with a fixed seed, so it is identical on every machine and
has enough structure for a tiny model's loss to fall. ``build_tiny_corpus(dir)`` writes:

    dir/corpus.jsonl            the documents (key "text")
    dir/tokenizer.model         a sentencepiece BPE model with ``vocab_size`` pieces
    dir/tokens.bin, tokens.idx  the corpus in Megatron's indexed format (prefix ``dir/tokens``)

It is idempotent: files that already exist are kept.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

_SUBJECTS = ["the model", "a layer", "the norm", "every token", "the optimizer", "a gradient",
             "the residual stream", "each head", "the scale", "our run"]
_VERBS = ["reads", "scales", "updates", "mixes", "keeps", "follows", "returns", "adds", "shrinks", "learns"]
_OBJECTS = ["the signal", "its variance", "a small number", "the next word", "the deep layers",
            "one value", "the weights", "a long sequence", "the loss", "every step"]
_ENDINGS = [".", " again.", " slowly.", " in order.", " at depth.", " once more."]


@dataclass(frozen=True)
class TinyCorpus:
    """Paths of a built tiny corpus."""

    directory: Path
    jsonl: Path
    tokenizer: Path
    prefix: Path
    vocab_size: int


def tiny_documents(num_documents: int, seed: int = 0) -> list[str]:
    """Deterministic grammar-generated documents of 3-12 sentences each."""
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        sentences = [f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
                     f"{rng.choice(_ENDINGS)}" for _ in range(rng.randint(3, 12))]
        documents.append(" ".join(sentences))
    return documents


def build_tiny_corpus(directory: str | os.PathLike, vocab_size: int = 200, num_documents: int = 400,
                      seed: int = 0) -> TinyCorpus:
    """Write (or reuse) the tiny corpus, its tokenizer and its token files under ``directory``."""
    from lnstrain.data.preprocess import PreprocessConfig, preprocess
    from lnstrain.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    corpus = TinyCorpus(directory, directory / "corpus.jsonl", directory / "tokenizer.model",
                        directory / "tokens", vocab_size)
    if not corpus.jsonl.is_file():
        temporary = corpus.jsonl.with_suffix(".tmp")
        with open(temporary, "w", encoding="utf-8") as handle:
            for text in tiny_documents(num_documents, seed):
                handle.write(json.dumps({"text": text}) + "\n")
        os.replace(temporary, corpus.jsonl)
    if not corpus.tokenizer.is_file():
        train_tokenizer(TokenizerTrainingConfig(inputs=[str(corpus.jsonl)], vocab_size=vocab_size,
                                                output_prefix=str(directory / "tokenizer"), num_threads=1,
                                                byte_fallback=False),
                        [str(corpus.jsonl)])
    if not Path(f"{corpus.prefix}.idx").is_file():
        preprocess(PreprocessConfig(inputs=[str(corpus.jsonl)], tokenizer=str(corpus.tokenizer),
                                    output_prefix=str(corpus.prefix), workers=1))
    return corpus


TINY_RUN_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tests" / "tiny.yaml"


def tiny_run_overrides(corpus: TinyCorpus, output_dir: str | os.PathLike) -> list[str]:
    """``--set`` overrides pointing ``configs/tests/tiny.yaml`` at ``corpus`` and ``output_dir``."""
    return [f"data.sources=[{{prefix: '{corpus.prefix}'}}]", f"data.tokenizer='{corpus.tokenizer}'",
            f"run.output_dir='{output_dir}'"]
