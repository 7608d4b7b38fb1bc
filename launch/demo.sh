#!/usr/bin/env bash
# The lnstrain demo: real text -> tokenizer -> token files -> a small LNS model trained for a few
# minutes (2 CPU cores suffice; a GPU is used when present). Everything goes to demo_workdir/;
# rerunning skips finished stages and resumes training from its latest checkpoint. Extra arguments
# go to launch/pretrain.py, e.g.
#     launch/demo.sh --set train.steps=50
#     launch/demo.sh --verbose            # DeepSpeed's informational messages too
#     NUM_RANKS=2 launch/demo.sh          # two data-parallel ranks through the DeepSpeed launcher
#     DEMO_WORKDIR=/tmp/demo launch/demo.sh   # everything somewhere else
#     launch/demo.sh --config configs/130m_lns.yaml   # another run: no demo data, the same launch
# Ctrl-C saves after the current step and prints the command that resumes (a second Ctrl-C stops at
# once); with NUM_RANKS > 1 through launch/slurm/preemptible.py, which makes the DeepSpeed launcher's
# ranks do the same.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${LNSTRAIN_RESUME_COMMAND:-}" ]]; then  # what a stopped run says to rerun: this command
    LNSTRAIN_RESUME_COMMAND=""
    for name in DEMO_WORKDIR NUM_RANKS; do
        [[ -z "${!name:-}" ]] || LNSTRAIN_RESUME_COMMAND+="$name=$(printf '%q' "${!name}") "
    done
    LNSTRAIN_RESUME_COMMAND+="bash launch/demo.sh"
    for arg in "$@"; do LNSTRAIN_RESUME_COMMAND+=" $(printf '%q' "$arg")"; done
    export LNSTRAIN_RESUME_COMMAND
fi
WORK=${DEMO_WORKDIR:-demo_workdir}
PYTHON=${PYTHON:-python}
NUM_RANKS=${NUM_RANKS:-1}
# Idle OpenMP threads sleep instead of spinning: on a CPU shared with other work, spinning threads
# slowed the demo many times over (docs/training.md, "CPU threads", has the measurement).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
OWN_CONFIG=0
for arg in "$@"; do [[ "$arg" == --config || "$arg" == --config=* ]] && OWN_CONFIG=1; done

ARGS=()
if (( OWN_CONFIG )); then
    echo "== training (the config given; no demo data needed)"
else
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
fi

if [[ "$NUM_RANKS" == 1 ]]; then
    "$PYTHON" launch/pretrain.py ${ARGS[@]+"${ARGS[@]}"} "$@"
elif command -v deepspeed >/dev/null 2>&1; then
    # Name the CPU accelerator when there is no GPU, or every launcher process warns that it fell back to it.
    "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
        export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    LAUNCHER=(deepspeed --num_gpus "$NUM_RANKS" --master_port "${MASTER_PORT:-$("$PYTHON" -c \
        'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}")
    # The launcher's own lines (its command, CUDA_VISIBLE_DEVICES, no hostfile: this is one machine)
    # only with --verbose; its errors always, except the line repeating an exit status that lnstrain's
    # own message has explained (1, 2, 3, 75, 130: lnstrain/training/outcome.py). The filter ignores
    # Ctrl-C, which is for the ranks: it must pass on what they print while they save.
    if [[ " $* " != *" --verbose "* ]] && deepspeed --help 2>/dev/null | grep -q -- --log_level; then
        LAUNCHER+=(--log_level error)
    fi
    EXPLAINED='^\[[0-9-]+ [0-9:,]+\] \[ERROR\] \[launch\.py:[0-9]+:sigkill_handler\] .* exits with return code = (1|2|3|75|130)$'
    status=0
    "$PYTHON" launch/slurm/preemptible.py -- "${LAUNCHER[@]}" launch/pretrain.py ${ARGS[@]+"${ARGS[@]}"} "$@" |
        (trap '' INT; grep --line-buffered -v -E "$EXPLAINED" || true) || status=$?
    (( status == 0 )) || exit "$status"
else
    echo "NUM_RANKS=$NUM_RANKS needs the deepspeed launcher on PATH" >&2
    exit 1
fi
echo "== done"
