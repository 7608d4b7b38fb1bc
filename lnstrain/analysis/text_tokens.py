"""Text to token ids the way a model's training saw them, and whether two vocabularies agree.

A `DocumentTokenizer` tokenizes the analysis's text (`--text`, `--mc-task`) with the model's own
tokenizer:

- lnstrain (`SentencePieceDocuments`): a document is its tokens then EOS, as
  `tools/preprocess_data.py` writes it by default; a question starts after the EOS separator;
- Hugging Face (`HFDocuments`): a document is what the tokenizer makes of it with its own special
  tokens (LLaMA and Mistral put BOS first, Qwen2 nothing), then EOS when the tokenizer has one and
  did not add it; a question starts with those leading special tokens (EOS when there are none).

A multiple-choice answer is scored as the continuation of its question after one space: its tokens
are those that `question + " " + answer` has beyond the question's own (sentencepiece marks a
word start by itself, so there the answer is tokenized alone, as before).

Token files (`--data`) carry no record of their tokenizer: `check_vocabularies_agree` compares the
tokenizer that made them, piece by piece, with the model's.

Every tokenizer has a `checksum` (SHA-256 of its files), which the analysis records with its windows.
A Hugging Face directory's tokenizer is looked for by its file names first (`hf_tokenizer_files`), so
that a directory without one is refused with that said, before any weight is read.
"""

from __future__ import annotations

import hashlib
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from lnstrain.data.tokenizer import Tokenizer, file_sha256

logger = logging.getLogger(__name__)
INSTALL_HINT = "pip install 'lnstrain[hf]' (transformers and safetensors)"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt",
                      "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
"""The files a Hugging Face tokenizer is made of (the first six hold a vocabulary); their checksum is its own."""
_HF_VOCABULARY_FILES = HF_TOKENIZER_FILES[:6]


class DocumentTokenizer(ABC):
    """A model's tokenizer, as the depth analysis uses it."""

    description: str
    checksum: str
    """SHA-256 of the tokenizer's files."""

    @abstractmethod
    def document(self, text: str) -> list[int]:
        """One document's ids as training saw it (special tokens included)."""

    @abstractmethod
    def question_prefix(self) -> list[int]:
        """Ids before a multiple-choice question (the document start)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Plain ids of a text, no special tokens."""

    @abstractmethod
    def continuation(self, context: str, text: str) -> list[int]:
        """Ids of `text` following `context` (a multiple-choice answer after its question)."""

    @abstractmethod
    def pieces(self) -> list[str]:
        """The vocabulary: the token string of every id 0..N-1."""


class SentencePieceDocuments(DocumentTokenizer):
    """An lnstrain run's sentencepiece model (`data.tokenizer`)."""

    def __init__(self, path: str) -> None:
        self.tokenizer = Tokenizer(path)
        self.description = f"sentencepiece {path}"
        self.checksum = file_sha256(path)

    def document(self, text: str) -> list[int]:
        eos = [self.tokenizer.eos_id] if self.tokenizer.eos_id >= 0 else []
        return self.tokenizer.encode(text) + eos

    def question_prefix(self) -> list[int]:
        return [self.tokenizer.eos_id] if self.tokenizer.eos_id >= 0 else []

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def continuation(self, context: str, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def pieces(self) -> list[str]:
        return [self.tokenizer.sp.id_to_piece(i) for i in range(self.tokenizer.vocab_size)]


class HFDocuments(DocumentTokenizer):
    """A Hugging Face tokenizer object (anything `AutoTokenizer.from_pretrained` returns)."""

    def __init__(self, tokenizer: Any, description: str, checksum: str) -> None:
        self.tokenizer = tokenizer
        self.description = description
        self.checksum = checksum

    def _with_specials(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])

    def document(self, text: str) -> list[int]:
        ids = self._with_specials(text)
        eos = self.tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def question_prefix(self) -> list[int]:
        leading = self._with_specials("")
        eos = self.tokenizer.eos_token_id
        return leading if leading else ([eos] if eos is not None else [])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def continuation(self, context: str, text: str) -> list[int]:
        context_ids = self.encode(context)
        whole = self.encode(f"{context} {text}")
        if whole[:len(context_ids)] == context_ids:
            return whole[len(context_ids):]
        return self.encode(f" {text}")  # the boundary merged into one token: tokenize the answer alone

    def pieces(self) -> list[str]:
        return [str(piece) for piece in self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))]


def import_transformers():
    """The transformers module, or ValueError saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"reading Hugging Face models needs transformers: {INSTALL_HINT} ({e})") from e
    return transformers


def hf_tokenizer_files(path: str | os.PathLike) -> list[Path]:
    """The tokenizer files in a Hugging Face directory; empty when none holds a vocabulary."""
    path = Path(path)
    present = [path / name for name in HF_TOKENIZER_FILES if (path / name).is_file()]
    return present if any(file.name in _HF_VOCABULARY_FILES for file in present) else []


def files_checksum(files: list[Path]) -> str:
    """One SHA-256 over the files' names and contents."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}:{file_sha256(str(file))}\n".encode())
    return digest.hexdigest()


def missing_tokenizer_text(path: str | os.PathLike) -> str:
    return f"{path} has no tokenizer (none of {', '.join(_HF_VOCABULARY_FILES)})"


def load_hf_tokenizer(path: str | os.PathLike) -> HFDocuments | None:
    """The directory's tokenizer, or None when it has no tokenizer files; files that are there but that
    transformers cannot read are a ValueError."""
    files = hf_tokenizer_files(path)
    if not files:
        logger.info("%s", missing_tokenizer_text(path))
        return None
    transformers = import_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                               trust_remote_code=False)
    except (OSError, ValueError, TypeError, ImportError) as e:
        raise ValueError(f"{path}: transformers cannot read its tokenizer ({', '.join(f.name for f in files)}): "
                         f"{e}") from e
    return HFDocuments(tokenizer, f"the Hugging Face tokenizer of {path}", files_checksum(files))


def load_data_tokenizer(path: str) -> DocumentTokenizer:
    """The tokenizer token files were made with: a sentencepiece .model, or a Hugging Face tokenizer
    directory (read with transformers, local files only)."""
    if os.path.isdir(path):
        tokenizer = load_hf_tokenizer(path)
        if tokenizer is None:
            raise ValueError(f"--data-tokenizer: {missing_tokenizer_text(path)}")
        return tokenizer
    return SentencePieceDocuments(path)


def check_vocabularies_agree(data: DocumentTokenizer, model: DocumentTokenizer, data_name: str) -> None:
    """Raise ValueError unless every id of `data`'s vocabulary is the same token in `model`'s."""
    data_pieces, model_pieces = data.pieces(), model.pieces()
    differ = [i for i, piece in enumerate(data_pieces) if i >= len(model_pieces) or model_pieces[i] != piece]
    if not differ:
        return
    examples = ", ".join(f"id {i}: {data_pieces[i]!r} vs "
                         f"{model_pieces[i]!r}" if i < len(model_pieces) else f"id {i}: {data_pieces[i]!r} vs none"
                         for i in differ[:3])
    raise ValueError(f"{data_name} was made with {data.description} ({len(data_pieces)} tokens), whose vocabulary "
                     f"is not the model's ({model.description}, {len(model_pieces)} tokens): {len(differ)} ids "
                     f"differ ({examples}). Tokenize text with the model's own tokenizer instead: "
                     f"--text FILE.jsonl")
