#!/usr/bin/env bash
# The GPU check of issue 12 in one command, for a machine with a GPU and no network: installs the
# carried wheelhouse (.whl/, built by ../shared/gpu/wheelhouse.sh: DeepSpeed and the few packages the
# GPU image lacks) into a temporary directory when DeepSpeed is not importable, then runs
# tools/gpu_check.py: the environment, the GPU test suite, the benchmarks, and one JSON + a Markdown
# table in --out (default $OUT, else gpu_check_results/). Everything after the script name goes to it:
#     bash launch/gpu_check.sh --only tests,memory          # stages: tests memory throughput compare layers7b
#     bash launch/gpu_check.sh --dry-run --out /tmp/dry     # the CPU, tiny shapes: the plumbing in a minute
# Nothing is downloaded. PYTHON picks the interpreter (default python3: the GPU image's torch).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import deepspeed" >/dev/null 2>&1; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        site=$(mktemp -d /tmp/lnstrain_site.XXXXXX)
        echo "== installing the carried wheels (.whl/) into $site"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
        export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    else
        echo "== WARNING: DeepSpeed is not importable and no .whl/ was carried (build it with" \
             "bash ../shared/gpu/wheelhouse.sh); the engine tests and benchmarks will fail" >&2
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" tools/gpu_check.py "$@"
