"""Shared fixtures of the data tests: a real-text demo corpus, one tiny tokenizer, tokenized files, and an
independent writer of Megatron's on-disk format (struct packing from the format description only)."""
from __future__ import annotations

import json
import os
import struct
import sys

import pytest

from tests.tool_scripts import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from lnstrain.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from lnstrain.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer  # noqa: E402

# Megatron-LM's dtype codes, restated here from docs/data.md, "The on-disk format" (not imported from lnstrain).
CODE_OF = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
STRUCT_OF = {"uint8": "B", "int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint16": "H"}


def write_megatron(prefix: str, documents: list[list[list[int]]], dtype: str = "uint16") -> None:
    """Independent writer: ``documents`` is a list of documents, each a list of sequences of token ids."""
    item = struct.calcsize("<" + STRUCT_OF[dtype])
    sizes, pointers, doc_idx, offset = [], [], [0], 0
    with open(prefix + ".bin", "wb") as b:
        for doc in documents:
            for seq in doc:
                b.write(struct.pack(f"<{len(seq)}{STRUCT_OF[dtype]}", *seq))
                sizes.append(len(seq))
                pointers.append(offset)
                offset += item * len(seq)
            doc_idx.append(len(sizes))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODE_OF[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def read_megatron(prefix: str) -> tuple[str, list[list[int]], list[int]]:
    """Independent reader (struct unpacking): (dtype name, sequences, document index)."""
    with open(prefix + ".idx", "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", data, 9)
    assert version == 1
    code = data[17]
    n, d = struct.unpack_from("<QQ", data, 18)
    sizes = struct.unpack_from(f"<{n}i", data, 34)
    pointers = struct.unpack_from(f"<{n}q", data, 34 + 4 * n)
    doc_idx = list(struct.unpack_from(f"<{d}q", data, 34 + 12 * n))
    assert len(data) == 34 + 12 * n + 8 * d
    dtype = {v: k for k, v in CODE_OF.items()}[code]
    fmt = STRUCT_OF[dtype]
    with open(prefix + ".bin", "rb") as f:
        binary = f.read()
    seqs = [list(struct.unpack_from(f"<{s}{fmt}", binary, p)) for s, p in zip(sizes, pointers)]
    return dtype, seqs, doc_idx


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> str:
    """Folder with train.jsonl/valid.jsonl of real stdlib docstrings (about 1 MB)."""
    out = str(tmp_path_factory.mktemp("demo_corpus"))
    assert load_tool("make_demo_corpus").main(["--output", out, "--max-mb", "1"]) == 0
    return out


@pytest.fixture(scope="session")
def demo_docs(demo_corpus) -> list[str]:
    with open(os.path.join(demo_corpus, "train.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="session")
def tokenizer_model(demo_corpus, tmp_path_factory) -> str:
    """A 500-piece BPE tokenizer with byte fallback, trained once per session."""
    prefix = str(tmp_path_factory.mktemp("tok") / "spm")
    cfg = TokenizerTrainingConfig(inputs=[], output_prefix=prefix, vocab_size=500, model_type="bpe")
    train_tokenizer(cfg, [os.path.join(demo_corpus, "train.jsonl")])
    return prefix + ".model"


@pytest.fixture(scope="session")
def demo_prefix(demo_corpus, tokenizer_model, tmp_path_factory) -> str:
    """The demo corpus's train.jsonl tokenized with our own preprocessing (one worker, in process)."""
    prefix = str(tmp_path_factory.mktemp("tokens") / "demo_train")
    preprocess(PreprocessConfig(inputs=[os.path.join(demo_corpus, "train.jsonl")], tokenizer=tokenizer_model,
                                output_prefix=prefix))
    return prefix


@pytest.fixture(scope="session")
def demo_token_docs(demo_prefix) -> list[list[int]]:
    """The tokenized demo documents, read back with the independent reader."""
    _, seqs, _ = read_megatron(demo_prefix)
    return seqs


@pytest.fixture
def copy_prefix(tmp_path):
    """Copy a token file pair into this test's own folder (so caches and corruptions stay local)."""
    def copy(prefix: str, name: str = "data") -> str:
        dst = str(tmp_path / name)
        for ext in (".bin", ".idx"):
            with open(prefix + ext, "rb") as src, open(dst + ext, "wb") as out:
                out.write(src.read())
        return dst
    return copy


@pytest.fixture(scope="session")
def megatron_writer():
    """The independent struct-packing writer (tests import fixtures, never this module)."""
    return write_megatron


@pytest.fixture(scope="session")
def megatron_reader():
    return read_megatron
