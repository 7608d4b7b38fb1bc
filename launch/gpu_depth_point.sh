#!/usr/bin/env bash
# The depth-width study's point near the paper's scale, in one device call (issue 33, item 4;
# docs/depth_width_study.md "The GPU point"): trains configs/studies/depth_width_gpu.yaml's Pre-LN /
# LNS pair at the paper's 130M shape on one GPU, one run after the other, each stopped (saved, exit 75)
# at RUN_LIMIT_S, then analyses every checkpoint with the study's own `collect` and packs what a fresh
# clone needs into one file, depth_point.tar.gz in --output (default $OUT, else gpu_depth_point/): the
# archived analyses (docs/depth_study/depth_width_gpu/), the reports, each run's config, final metrics,
# TensorBoard events and log. The checkpoints stay behind.
#
#     bash launch/gpu_depth_point.sh                      # on the GPU machine, .whl/ and depth_study/ carried
#     tar xzf depth_point.tar.gz                          # here, in the repository, then:
#     python launch/scaling_study.py collect configs/studies/depth_width_gpu.yaml
#
# Needs the depth study's token files and tokenizer in depth_study/ (launch/depth_study.sh data) and,
# where DeepSpeed is missing, the wheelhouse in .whl/ (python tools/build_wheelhouse.py). Nothing is
# downloaded. STUDY picks another study file (the CPU check of this script uses a tiny one).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
STUDY=${STUDY:-configs/studies/depth_width_gpu.yaml}
RUN_LIMIT_S=${RUN_LIMIT_S:-100}
out=${OUT:-gpu_depth_point}
while (($#)); do
    case "$1" in
        --output) out=$2; shift 2 ;;
        *) echo "usage: $0 [--output DIR]" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
log="$out/depth_point.log"
exec > >(tee -a "$log") 2> >(tee -a "$log" >&2)  # the log has both; errors stay on stderr

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
needed=$("$PYTHON" -c "
import sys
from lnstrain.study.spec import load_study
spec = load_study(sys.argv[1]).spec
print(spec.data_prefix + '.bin', (spec.depth.data + '.bin') if spec.depth else '', spec.tokenizer)" "$STUDY") || exit 2
for file in $needed; do
    if [ ! -f "$file" ]; then
        echo "gpu_depth_point: $file is missing (named by $STUDY); for the depth-width study build it here with" \
             "bash launch/depth_study.sh data, then carry depth_study/data and depth_study/tokenizer" >&2
        exit 2
    fi
done
if ! "$PYTHON" -c "import deepspeed" >/dev/null 2>&1; then
    echo "== installing the carried wheelhouse (.whl/) offline"
    exports=$(PYTHON="$PYTHON" bash launch/install_wheelhouse.sh .whl) || exit 2
    eval "$exports"
fi
"$PYTHON" -c "import torch; print('== torch', torch.__version__, 'on', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'the CPU')"

runs_dir=$("$PYTHON" -c "import sys; from lnstrain.study.spec import load_study; print(load_study(sys.argv[1]).output_dir)" "$STUDY") || exit 2
"$PYTHON" launch/scaling_study.py run "$STUDY" --no-launch || exit 2
for config in "$runs_dir"/*/study_config.yaml; do
    run_dir=$(dirname "$config")
    echo "== $(date +%T) training $(basename "$run_dir") (stopped and saved at ${RUN_LIMIT_S} s if not done)"
    code=0
    timeout -s TERM -k 30 "$RUN_LIMIT_S" "$PYTHON" launch/pretrain.py --config "$config" >"$run_dir/train.log" 2>&1 || code=$?
    tail -n 4 "$run_dir/train.log"
    echo "== $(date +%T) $(basename "$run_dir"): exit $code (0 finished, 75 or 124 stopped early)"
done
echo "== $(date +%T) analysing every checkpoint (the study's collect)"
"$PYTHON" launch/scaling_study.py collect "$STUDY" || echo "== collect exited $?"

archive=$("$PYTHON" -c "import sys; from lnstrain.study.spec import load_study; s = load_study(sys.argv[1]); print(s.spec.depth.archive if s.spec.depth else '')" "$STUDY")
packed=()
[ -n "$archive" ] && [ -d "$archive" ] && packed+=("$archive")
[ -d "$runs_dir/_study" ] && packed+=("$runs_dir/_study")
for run_dir in "$runs_dir"/*/; do
    for kept in study_config.yaml config.yaml final_metrics.json train.log tensorboard; do
        [ -e "$run_dir$kept" ] && packed+=("$run_dir$kept")
    done
done
tar czf "$out/depth_point.tar.gz" "${packed[@]}"
echo "== $(date +%T) packed ${#packed[@]} paths into $out/depth_point.tar.gz ($(du -h "$out/depth_point.tar.gz" | cut -f1))"
