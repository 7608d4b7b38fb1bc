"""The checkpoint tests share the training tests' session corpus."""

from tests.training.conftest import tiny_corpus  # noqa: F401  (a fixture, used by name)
