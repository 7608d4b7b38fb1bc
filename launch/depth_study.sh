#!/usr/bin/env bash
# Where does the LNS paper's pruning claim turn? The depth study of docs/depth_analysis.md: builds the
# depth studies' pinned ~40 MB docstring corpus (docs/depth_study/corpus.manifest.json), trains Pre-LN, LNS and
# lns_gain_init at the depth demo's size (configs/studies/depth_turn.yaml, one run after another,
# one thread each, niced), then analyses every run's checkpoints and compares the schemes.
#
#     launch/depth_study.sh                 # everything: hours on a 2-core CPU; rerunning resumes
#     launch/depth_study.sh collect         # only the analyses and reports of what has finished
#     launch/depth_study.sh data            # only the corpus (launch/depth_width_study.sh uses it too)
#
# The corpus is rebuilt bit for bit from its manifest: every source file the study's corpus came from
# (CPython 3.11.7's stdlib and 126 packages at pinned versions), checked by SHA-256. Files this
# machine lacks are read from wheels or source archives in CORPUS_PACKAGES (default
# depth_study/corpus_packages; never installed); when some are missing, the data step stops with exit 2
# and the one `pip download` line that fetches them there.
# DEPTH_CORPUS=installed builds an unpinned corpus from this machine's packages instead (other data:
# the archive's analyses will not count as made on it).
#
# Outputs (git-ignored): depth_study/{corpus,tokenizer,data,runs}; reports in
# depth_study/runs/_study/ (results.md, depth/report.md, depth/*.png). Every checkpoint's analysis is
# also kept in docs/depth_study/ (committed, depth.archive): `collect` on a machine without the
# checkpoints regenerates the depth report from it, provided the corpus built here is the same (the
# archive records its hashes; docs/depth_analysis.md gives the SHA-256 of the token file), or that no
# corpus is here (`collect` does not build one; archive files of format 1 need the corpus).
#
# Two runs at once on 2 cores, in stages (what docs/depth_analysis.md's results came from):
#     python launch/scaling_study.py run configs/studies/depth_turn.yaml --no-launch
#     OMP_NUM_THREADS=1 nice -n 19 python launch/pretrain.py \
#         --config depth_study/runs/<run>/study_config.yaml --stop-at-step 2400   # and so on
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
WORK=depth_study
STUDY=configs/studies/depth_turn.yaml
CORPUS_MANIFEST=docs/depth_study/corpus.manifest.json
CORPUS_PACKAGES=${CORPUS_PACKAGES:-$WORK/corpus_packages}   # wheels and source archives the rebuild may read
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

if [[ "${1:-run}" != collect && ( ! -s "$WORK/data/train.idx" || ! -s "$WORK/data/valid.idx" ) ]]; then
    mkdir -p "$WORK/tokenizer" "$WORK/data"
    if [[ "${DEPTH_CORPUS:-pinned}" == installed ]]; then
        echo "== building an unpinned docstring corpus from this machine's packages, its tokenizer and token files in $WORK/"
        "$PYTHON" tools/make_demo_corpus.py --output "$WORK/corpus" --max-mb 40 --site-packages
    else
        echo "== rebuilding the pinned docstring corpus ($CORPUS_MANIFEST), its tokenizer and token files in $WORK/"
        "$PYTHON" tools/make_demo_corpus.py --output "$WORK/corpus" --from-manifest "$CORPUS_MANIFEST" \
            --packages "$CORPUS_PACKAGES" || { echo "!! then run $0 data again" >&2; exit 2; }
    fi
    "$PYTHON" tools/train_tokenizer.py --input "$WORK/corpus/train.jsonl" --output-prefix "$WORK/tokenizer/docstrings" \
        --vocab-size 2048 --model-type bpe --threads 1
    for split in train valid; do
        "$PYTHON" tools/preprocess_data.py --input "$WORK/corpus/$split.jsonl" \
            --tokenizer "$WORK/tokenizer/docstrings.model" --output-prefix "$WORK/data/$split" --workers 1 --quiet
    done
fi

[[ "${1:-run}" == data ]] && exit 0
if [[ "${1:-run}" != collect ]]; then
    echo "== training $STUDY (one run after another; rerunning resumes)"
    nice -n 19 "$PYTHON" launch/scaling_study.py run "$STUDY" || echo "!! some runs failed (see their launch.log)"
fi
echo "== collecting $STUDY"
nice -n 19 "$PYTHON" launch/scaling_study.py collect "$STUDY"
