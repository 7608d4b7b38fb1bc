#!/usr/bin/env bash
# The GPU check in one command, for a machine with a GPU and no package index: installs the carried
# wheelhouse (.whl/, built here by `python tools/build_wheelhouse.py`: DeepSpeed and what the GPU image
# lacks) when DeepSpeed is not importable, then runs tools/gpu_check.py: by default the first call's
# items (`python tools/gpu_check.py --plan` lists them with their seconds; the whole call fits in 540 s),
# into one JSON, a Markdown table and a log in --output (default $OUT, else gpu_check_results/).
#     bash launch/gpu_check.sh                   # the decisive first call
#     bash launch/gpu_check.sh --call 2          # the optional second call (the whole GPU suite, 7B width, ...)
#     bash launch/gpu_check.sh --dry-run --output /tmp/dry     # the CPU, tiny shapes: the plumbing
# Nothing is downloaded. PYTHON picks the interpreter (default python3: the GPU image's torch).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
started_at=$(date +%s.%N)
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import deepspeed" >/dev/null 2>&1; then
    if [ -f .whl/requirements.txt ]; then
        echo "== installing the carried wheelhouse (.whl/) offline"
        if exports=$(PYTHON="$PYTHON" bash launch/install_wheelhouse.sh .whl); then
            eval "$exports"
            LNSTRAIN_WHEEL_INSTALL=installed
        else
            LNSTRAIN_WHEEL_INSTALL="failed (see the log above)"
        fi
    else
        LNSTRAIN_WHEEL_INSTALL="no .whl/requirements.txt carried (build it with python tools/build_wheelhouse.py)"
        echo "== WARNING: DeepSpeed is not importable and $LNSTRAIN_WHEEL_INSTALL; engine items will be skipped" >&2
    fi
    export LNSTRAIN_WHEEL_INSTALL LNSTRAIN_WHEEL_INSTALL_END=$(date +%s.%N)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" tools/gpu_check.py --started-at "$started_at" "$@"
