#!/usr/bin/env bash
# From a fresh clone to a trained model, in one command:
#
#     bash launch/train.sh                                   # the demo: corpus, tokenizer, a small LNS model
#     bash launch/train.sh --set train.steps=300             # extra arguments go to launch/pretrain.py
#     bash launch/train.sh --config configs/130m_lns.yaml    # your own run instead of the demo
#     NUM_RANKS=2 bash launch/train.sh                       # two ranks through the DeepSpeed launcher
#
# Creates (or reuses) the virtual environment .venv with the right torch build for this machine and
# lnstrain installed (launch/environment.sh says how; rerunning installs nothing when setup.py has not
# changed), then runs launch/demo.sh, which builds the demo data if missing and trains. Rerunning
# resumes the run; Ctrl-C saves after the current step and says how to resume.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=launch/environment.sh
source launch/environment.sh
lnstrain_environment ""

# What a stopped run tells the user to rerun: this very command, with the settings that place it.
LNSTRAIN_RESUME_COMMAND=""
for name in LNSTRAIN_VENV DEMO_WORKDIR NUM_RANKS; do
    [[ -z "${!name:-}" ]] || LNSTRAIN_RESUME_COMMAND+="$name=$(printf '%q' "${!name}") "
done
LNSTRAIN_RESUME_COMMAND+="bash launch/train.sh"
for arg in "$@"; do LNSTRAIN_RESUME_COMMAND+=" $(printf '%q' "$arg")"; done
export LNSTRAIN_RESUME_COMMAND
exec bash launch/demo.sh "$@"
