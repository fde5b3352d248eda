#!/usr/bin/env bash
# Purlin's developer commands. Needs only python3 (>= 3.10) with its venv module and 3 GB free.
#
#   ./dev.sh purlin ...  set up .venv with .[notebook] and run the `purlin` command line, e.g.
#                        ./dev.sh purlin describe all-reduce --ranks 4 (./dev.sh purlin --help)
#   ./dev.sh demo        set up .venv with .[notebook] and run `purlin demo`: the tour notebook,
#                        headless, on the cpu datapath; writes outputs/demo-timeline.html
#   ./dev.sh lab         set up .venv with .[notebook] and open JupyterLab on notebooks/
#   ./dev.sh test        set up .venv with .[test] and run pytest (arguments go to pytest)
#
# The first run checks python3, its venv module and the free disk, then installs into .venv
# (about 2.3 GB, a few minutes: numba-cuda[cu13] brings ~800 MB of CUDA wheels); later runs
# skip pip while pyproject.toml is unchanged. PYTHON=/path/to/python3 picks the interpreter.
# PURLIN_SKIP_TORCH=1 skips the pinned torch (a GPU machine brings its own CUDA build).
set -euo pipefail

CALLER_DIR=$PWD  # `./dev.sh purlin` runs where you called it: relative paths stay yours
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD
VENV=.venv
STAMP="$VENV/purlin-install.stamp"
NEED_KB=$((3 * 1024 * 1024))  # the venv takes ~2.3 GB; refuse below 3 GB free
# The CPU wheel of this exact release lies on our machines' disk; a looser spec would download
# a multi-GB CUDA build. It goes in before the package so nothing else picks another torch.
TORCH_PIN="torch==2.13.0"

usage() {  # the comment block at the top of this file
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

die() {
    echo "dev.sh: $*" >&2
    exit 2
}

# check_prerequisites PY: what creating the venv needs, each with what to install when missing.
check_prerequisites() {
    local py=$1 probe version bundled_pip minor free_kb
    command -v "$py" >/dev/null || die "$py not found. Install Python >= 3.10 with its venv" \
        "module (Debian/Ubuntu: sudo apt-get install python3 python3-venv; elsewhere:" \
        "python.org), or point PYTHON at one: PYTHON=/path/to/python3 ./dev.sh ..."
    # One probe: the version, then the pip that ensurepip would put into a venv (or "none").
    probe=$("$py" -c '
import sys
print("%d.%d.%d" % tuple(sys.version_info[:3]))
try:
    import ensurepip, venv
    print(ensurepip.version())
except ImportError:
    print("none")
' 2>/dev/null) || die "$py does not run (it exited with an error); install Python >= 3.10" \
        "or set PYTHON=/path/to/python3"
    version=$(sed -n 1p <<<"$probe")
    bundled_pip=$(sed -n 2p <<<"$probe")
    minor=${version#3.}
    minor=${minor%%.*}
    if [[ ! "$version" =~ ^3\.[0-9]+ ]] || [ "$minor" -lt 10 ]; then
        die "$py is Python $version; Purlin needs >= 3.10. Install a newer python3" \
            "(Debian/Ubuntu: sudo apt-get install python3.11 python3.11-venv) and run" \
            "PYTHON=python3.11 ./dev.sh ..."
    fi
    if [ "$bundled_pip" = none ] || [ -z "$bundled_pip" ]; then
        die "$py (Python $version) has no venv module with ensurepip, which creates .venv" \
            "and its pip. Debian/Ubuntu: sudo apt-get install python3.$minor-venv" \
            "(python3-venv for the distribution's python3); elsewhere use a python.org Python"
    fi
    free_kb=$(df -Pk . 2>/dev/null | awk 'NR == 2 { print $4 }')
    if [[ "$free_kb" =~ ^[0-9]+$ ]] && [ "$free_kb" -lt "$NEED_KB" ]; then
        die "only $(gb "$free_kb") GB free on the disk of $PWD; .venv takes about 2.3 GB:" \
            "free at least 3 GB (or clone onto a bigger disk) and run again"
    fi
}

gb() {  # kilobytes -> gigabytes with one decimal
    awk -v kb="$1" 'BEGIN { printf "%.1f", kb / 1024 / 1024 }'
}

make_venv() {
    local py=${PYTHON:-python3}
    [ -x "$VENV/bin/python" ] && return 0
    check_prerequisites "$py"
    echo "dev.sh: creating $VENV with $py"
    if ! "$py" -m venv "$VENV"; then
        rm -rf "$VENV"  # half a venv would fail later in a less clear way
        die "$py -m venv $VENV failed (its message is above); on Debian/Ubuntu install" \
            "python3-venv"
    fi
    "$VENV/bin/python" -m pip --version >/dev/null 2>&1 || {
        rm -rf "$VENV"
        die "$VENV has no pip after $py -m venv; on Debian/Ubuntu install python3-venv"
    }
}

# Prints the hash the stamp records: pyproject.toml plus the torch choice.
install_hash() {
    "$VENV/bin/python" - "${PURLIN_SKIP_TORCH:-0}" <<'EOF'
import hashlib, sys
data = open("pyproject.toml", "rb").read() + b"\0skip_torch=" + sys.argv[1].encode()
print(hashlib.sha256(data).hexdigest())
EOF
}

# setup EXTRA...: install the package with these extras unless the stamp says it is done.
setup() {
    make_venv
    local want=("$@") hash installed=() missing=() extra
    hash=$(install_hash)
    if [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$hash" ]; then
        read -r -a installed <<<"$(sed -n 2p "$STAMP")"
    fi
    for extra in "${want[@]}"; do
        [[ " ${installed[*]-} " == *" $extra "* ]] || missing+=("$extra")
    done
    [ ${#missing[@]} -eq 0 ] && return 0

    local all=("${installed[@]+"${installed[@]}"}" "${missing[@]}")
    local spec
    spec=".[$(IFS=,; echo "${all[*]}")]"
    echo "dev.sh: installing $spec into $VENV (the first time takes a few minutes)"
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
    if [ "${PURLIN_SKIP_TORCH:-0}" != 1 ]; then
        "${pip[@]}" install --progress-bar off "$TORCH_PIN"
    fi
    "${pip[@]}" install --progress-bar off -e "$spec"
    # pyproject's test extra includes notebook and viz
    [[ " ${all[*]} " == *" test "* ]] && all+=(notebook viz)
    printf '%s\n%s\n' "$hash" "${all[*]}" >"$STAMP"
}

cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
    test)
        setup test
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    purlin)
        setup notebook
        cd "$CALLER_DIR"
        exec "$ROOT/$VENV/bin/purlin" "$@"
        ;;
    demo)
        setup notebook
        cd "$CALLER_DIR"
        exec "$ROOT/$VENV/bin/purlin" demo "$@"
        ;;
    lab)
        setup notebook
        root_ok=()
        [ "$(id -u)" -eq 0 ] && root_ok=(--allow-root)  # Jupyter refuses root without it
        exec "$VENV/bin/jupyter" lab --notebook-dir=notebooks "${root_ok[@]+"${root_ok[@]}"}" "$@"
        ;;
    help | -h | --help)
        usage
        ;;
    *)
        usage >&2
        die "unknown command '$cmd'"
        ;;
esac
