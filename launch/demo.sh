#!/usr/bin/env bash
# The lnstrain demo: real text -> tokenizer -> token files -> a small LNS model trained for a few
# minutes (2 CPU cores suffice; a GPU is used when present). Everything goes to demo_workdir/;
# rerunning skips finished stages and resumes training from its latest checkpoint (or stops at once
# when training already finished). Extra arguments go to launch/pretrain.py, e.g.
#     launch/demo.sh --set train.steps=50
#     NUM_RANKS=2 launch/demo.sh          # two data-parallel ranks through the DeepSpeed launcher
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK=demo_workdir
PYTHON=${PYTHON:-python}
NUM_RANKS=${NUM_RANKS:-1}
mkdir -p "$WORK/corpus" "$WORK/tokenizer" "$WORK/data"

if [[ ! -s "$WORK/corpus/train.jsonl" ]]; then
    echo "== 1/4 building the demo corpus (Python standard library docstrings)"
    "$PYTHON" tools/make_demo_corpus.py --output "$WORK/corpus" --max-mb 5
else
    echo "== 1/4 demo corpus present"
fi

if [[ ! -s "$WORK/tokenizer/demo.model" ]]; then
    echo "== 2/4 training a 2048-piece BPE tokenizer"
    "$PYTHON" tools/train_tokenizer.py --input "$WORK/corpus/train.jsonl" --output-prefix "$WORK/tokenizer/demo" \
        --vocab-size 2048 --model-type bpe
else
    echo "== 2/4 tokenizer present"
fi

for split in train valid; do
    if [[ ! -s "$WORK/data/demo_$split.idx" ]]; then
        echo "== 3/4 tokenizing the $split split"
        "$PYTHON" tools/preprocess_data.py --input "$WORK/corpus/$split.jsonl" \
            --tokenizer "$WORK/tokenizer/demo.model" --output-prefix "$WORK/data/demo_$split" --quiet
    else
        echo "== 3/4 $split tokens present"
    fi
done

echo "== 4/4 training (configs/demo.yaml; logs and checkpoints in $WORK/runs/demo)"
if command -v deepspeed >/dev/null 2>&1; then
    deepspeed --num_gpus "$NUM_RANKS" launch/pretrain.py --config configs/demo.yaml "$@"
elif [[ "$NUM_RANKS" == 1 ]]; then
    "$PYTHON" launch/pretrain.py --config configs/demo.yaml "$@"
else
    echo "NUM_RANKS=$NUM_RANKS needs the deepspeed launcher on PATH" >&2
    exit 1
fi
echo "== done: TensorBoard with  tensorboard --logdir $WORK/runs/demo/tensorboard"
