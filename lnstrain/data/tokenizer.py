"""Thin wrapper around a sentencepiece ``.model`` (trained here, or any existing one such as T5's or LLaMA's)."""
from __future__ import annotations

import hashlib
import os

import sentencepiece as spm


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    """A sentencepiece model with the ids the data path needs.

    Attributes: ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``unk_id`` (-1 when the model has none),
    ``checksum`` (sha256 of the ``.model`` file, stored in checkpoints), ``model_path``.
    """

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model not found: {model_path} (train one with "
                                    "tools/train_tokenizer.py or give an existing sentencepiece .model)")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{model_path}: not a valid sentencepiece model ({e})") from e
        self.vocab_size: int = self.sp.GetPieceSize()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()
        self.unk_id: int = self.sp.unk_id()
        self.checksum: str = file_sha256(model_path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several texts in one call (single-threaded, so worker counts stay honest)."""
        return self.sp.Encode(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def __repr__(self) -> str:
        return (f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id})")
