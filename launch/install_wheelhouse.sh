#!/usr/bin/env bash
# Install a wheelhouse built by tools/build_wheelhouse.py on a machine without a package index, beside the
# Python packages it already has (torch above all): pip --no-index takes from the wheelhouse only what is
# missing, into a prefix of its own. Prints the one line to evaluate:
#     eval "$(bash launch/install_wheelhouse.sh .whl)"        # then `import deepspeed` works
# Arguments: the wheelhouse (default .whl), the prefix (default a new /tmp/lnstrain_site.*). PYTHON picks
# the interpreter (default python3). Exit 1 with pip's message when a requirement is in neither place.
set -euo pipefail
wheelhouse=${1:-.whl}
prefix=${2:-$(mktemp -d /tmp/lnstrain_site.XXXXXX)}
PYTHON=${PYTHON:-python3}
if [ ! -f "$wheelhouse/requirements.txt" ]; then
    echo "install_wheelhouse: $wheelhouse/requirements.txt not found; build it with: python tools/build_wheelhouse.py" >&2
    exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-compile --disable-pip-version-check --find-links "$wheelhouse" \
    --prefix "$prefix" -r "$wheelhouse/requirements.txt" >&2
site=$("$PYTHON" -c 'import sys, sysconfig; print(sysconfig.get_path("purelib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$prefix")
echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH} PATH=$prefix/bin:\$PATH"
