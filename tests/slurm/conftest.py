"""Fixtures of the SLURM tests: a one-node SLURM on this machine (skipped where it cannot run) and the
session's tiny corpus. SLURM is installed only when LNSTRAIN_TEST_INSTALL_SLURM=1 asks for it (.ci/run
does); otherwise the tests use an installed SLURM or skip, and the machine is left as it was."""

from __future__ import annotations

import pytest

from lnstrain.testing.local_slurm import LocalSlurm, install_requested, start, unavailable_reason
from tests.training.conftest import tiny_corpus  # noqa: F401  (the same session fixture)


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory) -> LocalSlurm:
    reason = unavailable_reason(install=install_requested())
    if reason:
        pytest.skip(f"no local SLURM: {reason}")
    slurm = start(tmp_path_factory.mktemp("slurm"))
    yield slurm
    slurm.stop()
