#!/usr/bin/env bash
# The Curse of Depth, seen on your CPU in minutes: train a deep, narrow model (16 layers of width 64)
# with Pre-LN and with LayerNorm Scaling on the demo corpus, then compare them layer by layer with
# tools/analyze_depth.py (output variance by depth, angular distance between layers, layer pruning)
# and check the LNS paper's claims on them: each verdict is computed from these runs.
#
#     launch/demo_depth.sh                          # -> demo_workdir/depth_compare/report.md
#     launch/demo_depth.sh --set train.steps=100    # extra arguments go to every training run
#     DEPTH_SEEDS="1234 1235" launch/demo_depth.sh  # several seeds per scheme: verdicts with their spread
#     DEPTH_OUT=/tmp/depth launch/demo_depth.sh     # runs and reports somewhere else
#     DEMO_WORKDIR=/tmp/demo launch/demo_depth.sh   # the demo data (and by default everything) there
#
# Reuses launch/demo.sh's corpus, tokenizer and token files in demo_workdir/ (built here if missing).
# Rerunning skips finished runs.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK=${DEMO_WORKDIR:-demo_workdir}
OUT=${DEPTH_OUT:-$WORK}
PYTHON=${PYTHON:-python}
SEEDS=(${DEPTH_SEEDS:-1234})
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

DATA=()
if [[ "$WORK" != demo_workdir ]]; then  # configs/demo_depth.yaml names demo_workdir/
    DATA=(--set "data.sources=[{prefix: '$WORK/data/demo_train'}]"
          --set "data.valid_sources=[{prefix: '$WORK/data/demo_valid'}]"
          --set "data.tokenizer='$WORK/tokenizer/demo.model'")
fi
ANALYSES=()
NAMES=()
CONFIGURATIONS=()  # a scheme's seeds are seeds of one configuration in the claim verdicts
for scheme in pre_ln lns; do
    for seed in "${SEEDS[@]}"; do
        run=demo_depth_$scheme
        name=$scheme
        if (( ${#SEEDS[@]} > 1 )); then
            run=${run}_s$seed
            name=${name}_s$seed
        fi
        echo "== training the $scheme model, seed $seed (configs/demo_depth_$scheme.yaml)"
        "$PYTHON" launch/pretrain.py --config "configs/demo_depth_$scheme.yaml" ${DATA[@]+"${DATA[@]}"} --set "run.output_dir=$OUT/runs" \
            --set "run.name=$run" --set "train.seed=$seed" --set "model.init_seed=$seed" "$@"
        echo "== analysing $run"
        "$PYTHON" tools/analyze_depth.py --checkpoint "$OUT/runs/$run/checkpoints" --data "$WORK/data/demo_valid" \
            --num-samples 64 --name "$name" --output "$OUT/depth_$name" > "$OUT/depth_$name.log" 2>&1 ||
            { cat "$OUT/depth_$name.log"; exit 1; }
        ANALYSES+=("$OUT/depth_$name")
        NAMES+=("$name")
        CONFIGURATIONS+=("$scheme")
    done
done

echo "== comparing the runs layer by layer, and checking the paper's claims on them"
"$PYTHON" tools/analyze_depth.py --compare "${ANALYSES[@]}" --names "${NAMES[@]}" --groups "${CONFIGURATIONS[@]}" \
    --output "$OUT/depth_compare"
cat <<'END'
== what to expect at this size: the LNS paper reports that LNS curbs the variance growth, lowers the
   loss and makes the deep layers matter more (its Fig. 4: a 130M-parameter LLaMA). lnstrain's own
   study of these 16-layer, width-64 models (up to 7.4M tokens) measured the first two, but found
   LNS's deep layers matter LESS than Pre-LN's when pruned, at every length; the verdicts above
   should say the same. Why, and the figures: docs/depth_analysis.md, section "Where the pruning
   claim turns: the depth study", its Results.
END
echo "== done: $OUT/depth_compare/report.md (TensorBoard: tensorboard --logdir $OUT/runs)"
