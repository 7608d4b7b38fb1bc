#!/usr/bin/env bash
# From a fresh clone to a passing test suite, in one command (CI runs exactly this: .ci/run):
#
#     bash launch/test.sh                                    # the whole suite, on CPU
#     bash launch/test.sh -m "not multirank and not slow"    # the quick subset
#     bash launch/test.sh tests/data -x                      # arguments go to pytest
#
# Creates (or reuses) the virtual environment .venv with the right torch build for this machine and
# lnstrain installed with its test extra (launch/environment.sh says how; rerunning installs nothing
# when setup.py has not changed), then runs pytest in it. The tests write only under temporary
# directories and install nothing else: the SLURM tests use an installed SLURM or skip, unless
# LNSTRAIN_TEST_INSTALL_SLURM=1 lets them apt-get it (CI's .ci/run does; docs/testing.md).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=launch/environment.sh
source launch/environment.sh
lnstrain_environment test
exec python -m pytest -q "$@"
