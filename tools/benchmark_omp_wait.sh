#!/usr/bin/env bash
# Training speed of the demo model with OpenMP's idle threads at their default (spin a while, then
# sleep) and with OMP_WAIT_POLICY=PASSIVE (sleep at once), on an otherwise idle machine and beside
# another 2-thread torch process multiplying matrices in a loop (as a second job on a shared machine
# would). Prints tokens/s over steps 21-30 of configs/demo.yaml. Needs launch/demo.sh's data first.
#     bash tools/benchmark_omp_wait.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
RUNS=$(mktemp -d)
trap 'rm -rf "$RUNS"; [[ -n ${NEIGHBOUR:-} ]] && kill "$NEIGHBOUR" 2>/dev/null || true' EXIT

tokens_per_s() {  # $1: OMP_WAIT_POLICY value, or "" for unset
    rm -rf "$RUNS/runs"
    env ${1:+OMP_WAIT_POLICY=$1} "$PYTHON" launch/pretrain.py --config configs/demo.yaml --set train.steps=30 \
        --set "run.output_dir=$RUNS/runs" --set train.eval_interval=0 --set checkpoint.interval_steps=0 \
        --set checkpoint.save_at_end=false 2>&1 | grep -o 'step 30/30 .* tokens/s' | grep -o '[0-9]* tokens/s'
}

echo "| machine | OMP_WAIT_POLICY unset | OMP_WAIT_POLICY=PASSIVE |"
echo "|---|---|---|"
echo "| idle, $(nproc) cores | $(tokens_per_s "") | $(tokens_per_s PASSIVE) |"
"$PYTHON" -c "import torch; torch.set_num_threads(2); a = torch.randn(256, 256); [a @ a for _ in iter(int, 1)]" &
NEIGHBOUR=$!
echo "| beside a 2-thread torch loop, $(nproc) cores | $(tokens_per_s "") | $(tokens_per_s PASSIVE) |"
