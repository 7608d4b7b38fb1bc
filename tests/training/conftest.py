"""Fixtures of the training and checkpoint tests: one tiny corpus and tokenizer per session."""

from __future__ import annotations

import pytest

from lnstrain.testing.tiny_corpus import TinyCorpus, build_tiny_corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> TinyCorpus:
    return build_tiny_corpus(tmp_path_factory.mktemp("tiny_corpus"))
