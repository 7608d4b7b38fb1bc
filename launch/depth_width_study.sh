#!/usr/bin/env bash
# Where the curse begins: the depth-width study of docs/depth_width_study.md
# (configs/studies/depth_width.yaml). Builds the depth study's docstring corpus if it is not there
# (launch/depth_study.sh data), then trains the study's runs in the pre-registered order, two at a
# time (Pre-LN in one lane, LNS in the other, so that each size's pair finishes together), one thread
# each, niced, in stages of STAGE_STEPS steps (each stage saves and exits 75; the next resumes it).
#
#     launch/depth_width_study.sh                # stages 1-3; rerunning resumes every unfinished run
#     launch/depth_width_study.sh stage 2        # one stage: 1 (seed 1234 to 16x128), 2 (seed 1235 to
#                                                # 16x128), 3 (16x192, seed 1234), 4 (16x192, seed 1235:
#                                                # only when collect's second-seed rule asks for it)
#     launch/depth_width_study.sh collect        # the reports of what has finished (also from the archive,
#                                                # in a fresh clone with no corpus or checkpoints)
#
# Logs: depth_study/depth_width/_logs/<run>.log (git-ignored, like the runs). Reports:
# depth_study/depth_width/_study/ (results.md, depth/report.md with the size trends). Every finished
# run's analysis is kept in docs/depth_study/depth_width/ (committed).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
STUDY=configs/studies/depth_width.yaml
OUT=depth_study/depth_width
STAGE_STEPS=${STAGE_STEPS:-1200}
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

stage_sizes() {   # the pre-registered order: the anchor, then depth, then width
    case "$1" in
        1) echo "depth16x64:1234 depth8x64:1234 depth32x64:1234 depth48x64:1234 depth16x128:1234" ;;
        2) echo "depth16x64:1235 depth8x64:1235 depth32x64:1235 depth48x64:1235 depth16x128:1235" ;;
        3) echo "depth16x192:1234" ;;
        4) echo "depth16x192:1235" ;;
        *) echo "unknown stage '$1' (1-4)" >&2; exit 2 ;;
    esac
}

train_run() {     # train_run RUN: every stage of one run; returns 0 when it finished
    local run=$1 config="$OUT/$1/study_config.yaml" log="$OUT/_logs/$1.log"
    local total done_step boundary code
    total=$("$PYTHON" -c "import sys; from lnstrain.config.run_config import load_config; print(load_config(sys.argv[1], validate=False).total_steps)" "$config")
    [[ -s "$OUT/$run/final_metrics.json" ]] && return 0
    done_step=$(ls "$OUT/$run/checkpoints" 2>/dev/null | sed -n 's/^global_step\([0-9]*\)$/\1/p' | sort -n | tail -1)
    for ((boundary = STAGE_STEPS; boundary < total; boundary += STAGE_STEPS)); do
        (( boundary <= ${done_step:-0} )) && continue
        code=0
        nice -n 19 "$PYTHON" launch/pretrain.py --config "$config" --stop-at-step "$boundary" >>"$log" 2>&1 || code=$?
        if (( code != 75 )); then echo "!! $run stopped with exit $code at stage $boundary (see $log)"; return 1; fi
    done
    code=0
    nice -n 19 "$PYTHON" launch/pretrain.py --config "$config" >>"$log" 2>&1 || code=$?
    (( code == 0 )) || { echo "!! $run stopped with exit $code (see $log)"; return 1; }
}

lane() {          # lane SCHEME STAGE...: that scheme's runs of the stages, one after another
    local scheme=$1 stage entry
    shift
    for stage in "$@"; do
        for entry in $(stage_sizes "$stage"); do
            local run="${entry%%:*}_${scheme}_s${entry##*:}"
            echo "== $(date +%H:%M) $run"
            train_run "$run" && echo "== $(date +%H:%M) $run finished" || true
        done
    done
}

case "${1:-run}" in
    collect) ;;   # needs neither the corpus nor the checkpoints: what is missing is read from the archive
    run|stage)
        launch/depth_study.sh data
        stages=(1 2 3)
        [[ "${1:-run}" == stage ]] && stages=("${2:?which stage (1-4)}")
        "$PYTHON" launch/scaling_study.py run "$STUDY" --no-launch >/dev/null
        mkdir -p "$OUT/_logs"
        lane pre_ln "${stages[@]}" >"$OUT/_logs/lane_pre_ln.log" 2>&1 &
        lane lns "${stages[@]}" >"$OUT/_logs/lane_lns.log" 2>&1 &
        wait
        ;;
    *) echo "usage: $0 [run | stage N | collect]" >&2; exit 2 ;;
esac
echo "== collecting $STUDY"
nice -n 19 "$PYTHON" launch/scaling_study.py collect "$STUDY"
