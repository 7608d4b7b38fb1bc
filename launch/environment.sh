# Sourced by launch/train.sh and launch/test.sh: create or reuse lnstrain's virtual environment,
# install what the command needs (once: a stamp records what was installed for which setup.py), and
# put the environment first on PATH. Not a command of its own.
#
#     LNSTRAIN_VENV=DIR     the environment to create or reuse (default: .venv in the repository)
#     LNSTRAIN_PYTHON=EXE   the Python that creates it (default: python3, else python; 3.10 or newer)
#     LNSTRAIN_TORCH="..."  pip arguments that install torch, instead of the choice below, e.g.
#                           LNSTRAIN_TORCH="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu121"
#
# torch: an environment that already imports torch keeps it. Otherwise, with a GPU that nvidia-smi
# lists, PyPI's torch (its Linux build is the CUDA one); without one the CPU build (PyPI's Linux build
# would download GBs of CUDA libraries a CPU never uses): a CPU wheel that pip's configured
# find-links already hold when there is one (a local mirror or wheel cache), else PyTorch's CPU index.

LNSTRAIN_CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

# lnstrain_pip_install PYTHON ARGS...: pip install, quiet; its output goes to pip.log in the
# environment and is shown only when it fails.
lnstrain_pip_install() {
    local python=$1 log
    shift
    log=$(dirname "$(dirname "$python")")/pip.log
    if ! "$python" -m pip install --quiet "$@" > "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "lnstrain: pip install $* failed (the whole output: $log)" >&2
        return 1
    fi
}

lnstrain_base_python() {
    local candidate
    for candidate in ${LNSTRAIN_PYTHON:-python3 python}; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "lnstrain: needs Python 3.10 or newer to create its environment; none found as ${LNSTRAIN_PYTHON:-python3 or python} (set LNSTRAIN_PYTHON=/path/to/python3.11)" >&2
    return 2
}

# The version of a torch CPU wheel for this Python that pip's find-links hold, or nothing.
lnstrain_local_cpu_torch() {
    "$1" - <<'EOF'
import glob, os, re, subprocess, sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
places = os.environ.get("PIP_FIND_LINKS", "").split()
for line in listed.splitlines():
    key, _, value = line.partition("=")
    if key.endswith("find-links"):
        places += value.strip().strip("'\"").split()
tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
versions = set()
for place in places:
    place = place[len("file://"):] if place.startswith("file://") else place
    for wheel in glob.glob(os.path.join(place, f"torch-*+cpu-{tag}-*.whl")):
        versions.add(os.path.basename(wheel).split("-")[1])
def key(version):
    return [int(part) for part in re.findall(r"\d+", version.split("+")[0])]
if versions:
    print(max(versions, key=key))
EOF
}

lnstrain_install_torch() {
    local python=$1 local_cpu
    if [[ -n "${LNSTRAIN_TORCH:-}" ]]; then
        echo "== installing torch: pip install $LNSTRAIN_TORCH (LNSTRAIN_TORCH)"
        # shellcheck disable=SC2086  # pip arguments, split on purpose
        lnstrain_pip_install "$python" $LNSTRAIN_TORCH
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        echo "== installing torch, the CUDA build (nvidia-smi lists a GPU)"
        lnstrain_pip_install "$python" torch
    elif local_cpu=$(lnstrain_local_cpu_torch "$python") && [[ -n "$local_cpu" ]]; then
        echo "== installing torch $local_cpu, the CPU build (no GPU; its wheel is in pip's find-links)"
        lnstrain_pip_install "$python" "torch==$local_cpu"
    else
        echo "== installing torch, the CPU build (no GPU: $LNSTRAIN_CPU_TORCH_INDEX)"
        lnstrain_pip_install "$python" torch --index-url "$LNSTRAIN_CPU_TORCH_INDEX"
    fi
}

# lnstrain_environment EXTRA: EXTRA is "" (training) or "test" (the test suite's packages too).
lnstrain_environment() {
    local extra=$1 venv=${LNSTRAIN_VENV:-$PWD/.venv} base stamp wanted installed
    if [[ ! -x "$venv/bin/python" ]]; then
        base=$(lnstrain_base_python) || return 2
        echo "== creating the virtual environment $venv ($("$base" --version 2>&1))"
        "$base" -m venv "$venv" || {
            echo "lnstrain: could not create $venv (on Debian/Ubuntu: apt-get install python3-venv)" >&2
            return 2
        }
        lnstrain_pip_install "$venv/bin/python" --upgrade pip || return 1
    fi
    local python=$venv/bin/python
    stamp=$venv/.lnstrain-installed
    # What is installed depends on setup.py and on this checkout (an editable install points at it).
    wanted="$(sha256sum setup.py | cut -d' ' -f1) $PWD"
    installed=$(cat "$stamp" 2>/dev/null || true)
    if [[ "$installed" == "$wanted test" || ( -z "$extra" && "$installed" == "$wanted " ) ]]; then
        echo "== environment $venv is up to date"
    else
        if "$python" -c 'import torch' 2>/dev/null; then
            echo "== keeping the installed torch $("$python" -c 'import torch; print(torch.__version__)')"
        else
            lnstrain_install_torch "$python" || return 1
        fi
        local target=. isolation=()
        [[ -n "$extra" ]] && target=".[$extra]"
        # A setuptools that builds editable wheels by itself (70.1+) spares pip a build environment.
        "$python" -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' \
            2>/dev/null && isolation=(--no-build-isolation)
        echo "== installing lnstrain and its dependencies (pip install -e \"$target\")"
        lnstrain_pip_install "$python" ${isolation[@]+"${isolation[@]}"} -e "$target" || return 1
        echo "$wanted $extra" > "$stamp"
    fi
    export VIRTUAL_ENV=$venv
    export PATH=$venv/bin:$PATH
    hash -r
}
