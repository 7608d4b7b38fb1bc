#!/usr/bin/env bash
# The lnstrain demo: real text -> tokenizer -> token files -> a small LNS model trained for a few
# minutes (2 CPU cores suffice; a GPU is used when present). Everything goes to demo_workdir/;
# rerunning skips finished stages and resumes training from its latest checkpoint. Extra arguments
# go to launch/pretrain.py, e.g.
#     launch/demo.sh --set train.steps=50
#     launch/demo.sh --verbose            # DeepSpeed's informational messages too
#     NUM_RANKS=2 launch/demo.sh          # two data-parallel ranks through the DeepSpeed launcher
#     DEMO_WORKDIR=/tmp/demo launch/demo.sh   # everything somewhere else
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
WORK=${DEMO_WORKDIR:-demo_workdir}
PYTHON=${PYTHON:-python}
NUM_RANKS=${NUM_RANKS:-1}
# Idle OpenMP threads sleep instead of spinning: on a CPU shared with other work, spinning threads
# slowed the demo many times over (docs/training.md, "CPU threads", has the measurement).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
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

ARGS=(--config configs/demo.yaml)
if [[ "$WORK" != demo_workdir ]]; then  # configs/demo.yaml names demo_workdir/
    ARGS+=(--set "data.sources=[{prefix: '$WORK/data/demo_train'}]"
           --set "data.valid_sources=[{prefix: '$WORK/data/demo_valid'}]"
           --set "data.tokenizer='$WORK/tokenizer/demo.model'" --set "run.output_dir='$WORK/runs'")
fi
echo "== 4/4 training (configs/demo.yaml; the first lines name the run directory)"
if [[ "$NUM_RANKS" == 1 ]]; then
    "$PYTHON" launch/pretrain.py "${ARGS[@]}" "$@"
elif command -v deepspeed >/dev/null 2>&1; then
    # Name the CPU accelerator when there is no GPU, or every launcher process warns that it fell back to it.
    "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
        export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    LAUNCHER=(deepspeed --num_gpus "$NUM_RANKS" --master_port "${MASTER_PORT:-$("$PYTHON" -c \
        'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}")
    # The launcher's own lines (its command, CUDA_VISIBLE_DEVICES, no hostfile: this is one machine)
    # only with --verbose; its errors always.
    if [[ " $* " != *" --verbose "* ]] && deepspeed --help 2>/dev/null | grep -q -- --log_level; then
        LAUNCHER+=(--log_level error)
    fi
    "${LAUNCHER[@]}" launch/pretrain.py "${ARGS[@]}" "$@"
else
    echo "NUM_RANKS=$NUM_RANKS needs the deepspeed launcher on PATH" >&2
    exit 1
fi
echo "== done"
