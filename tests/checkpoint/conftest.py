"""The checkpoint tests share the training tests' session corpus, and one stopped run to attack."""

import pytest

from lnstrain.testing.distributed import run_distributed
from tests.checkpoint.tampering import StoppedRun, make_key, train_stopped_run
from tests.training.conftest import tiny_corpus  # noqa: F401  (a fixture, used by name)


@pytest.fixture(scope="session")
def stopped_run(tiny_corpus, tmp_path_factory) -> StoppedRun:  # noqa: F811
    """A tiny run stopped at step 4, its markers signed (tampering.train_stopped_run): about 10 s."""
    root = tmp_path_factory.mktemp("stopped_run")
    key = make_key(tmp_path_factory.mktemp("keys") / "run.key")
    [straight] = run_distributed(train_stopped_run, 1, tiny_corpus, root, key, timeout_s=300)
    return StoppedRun(root, tiny_corpus, key, straight)
