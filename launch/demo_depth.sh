#!/usr/bin/env bash
# The Curse of Depth, seen on your CPU in minutes: train a deep, narrow model (16 layers of width 64)
# with Pre-LN and with LayerNorm Scaling on the demo corpus, then compare them layer by layer with
# tools/analyze_depth.py (output variance by depth, angular distance between layers, layer pruning).
#
#     launch/demo_depth.sh                          # -> demo_workdir/depth_compare/report.md
#     launch/demo_depth.sh --set train.steps=100    # extra arguments go to both training runs
#     DEPTH_OUT=/tmp/depth launch/demo_depth.sh     # runs and reports somewhere else
#
# Reuses launch/demo.sh's corpus, tokenizer and token files in demo_workdir/ (built here if missing).
# Rerunning skips finished runs.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK=demo_workdir
OUT=${DEPTH_OUT:-$WORK}
PYTHON=${PYTHON:-python}
# Idle OpenMP threads sleep instead of spinning: on a busy CPU, spinning threads slowed the demo ~10x.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

if [[ ! -s "$WORK/data/demo_train.idx" || ! -s "$WORK/data/demo_valid.idx" || ! -s "$WORK/tokenizer/demo.model" ]]; then
    echo "== building the demo data (launch/demo.sh, data stages)"
    mkdir -p "$WORK/corpus" "$WORK/tokenizer" "$WORK/data"
    [[ -s "$WORK/corpus/train.jsonl" ]] || "$PYTHON" tools/make_demo_corpus.py --output "$WORK/corpus" --max-mb 5
    [[ -s "$WORK/tokenizer/demo.model" ]] || "$PYTHON" tools/train_tokenizer.py --input "$WORK/corpus/train.jsonl" \
        --output-prefix "$WORK/tokenizer/demo" --vocab-size 2048 --model-type bpe
    for split in train valid; do
        [[ -s "$WORK/data/demo_$split.idx" ]] || "$PYTHON" tools/preprocess_data.py --input "$WORK/corpus/$split.jsonl" \
            --tokenizer "$WORK/tokenizer/demo.model" --output-prefix "$WORK/data/demo_$split" --quiet
    done
fi

for scheme in pre_ln lns; do
    echo "== training the $scheme model (configs/demo_depth_$scheme.yaml)"
    "$PYTHON" launch/pretrain.py --config "configs/demo_depth_$scheme.yaml" --set "run.output_dir=$OUT/runs" "$@"
done

echo "== comparing the two runs layer by layer"
for scheme in pre_ln lns; do
    "$PYTHON" tools/analyze_depth.py --checkpoint "$OUT/runs/demo_depth_$scheme/checkpoints" \
        --data "$WORK/data/demo_valid" --num-samples 64 --name "$scheme" --output "$OUT/depth_$scheme"
done
"$PYTHON" tools/analyze_depth.py --compare "$OUT/depth_pre_ln" "$OUT/depth_lns" --names Pre-LN LNS \
    --output "$OUT/depth_compare"
echo "== done: $OUT/depth_compare/report.md (TensorBoard: tensorboard --logdir $OUT/runs)"
