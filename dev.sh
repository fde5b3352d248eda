#!/usr/bin/env bash
# Purlin's developer commands. Needs only python3 (>= 3.10) with pip and venv.
#
#   ./dev.sh demo   set up .venv with .[notebook] and run `purlin demo`: the tour notebook,
#                   headless, on the cpu datapath; writes out/demo-timeline.html (--out DIR)
#   ./dev.sh lab    set up .venv with .[notebook] and open JupyterLab on notebooks/
#   ./dev.sh test   set up .venv with .[test] and run pytest (extra arguments go to pytest)
#
# The first run installs into .venv (a few minutes: numba-cuda[cu13] brings ~800 MB of CUDA
# wheels); later runs skip pip while pyproject.toml is unchanged. PURLIN_SKIP_TORCH=1 skips the
# pinned torch (for a GPU machine that brings its own CUDA build of torch).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=.venv
STAMP="$VENV/purlin-install.stamp"
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

make_venv() {
    local py=${PYTHON:-python3}
    command -v "$py" >/dev/null || die "$py not found; install Python >= 3.10"
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$py is Python $("$py" -c 'import platform; print(platform.python_version())'); Purlin needs >= 3.10"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "dev.sh: creating $VENV"
        "$py" -m venv "$VENV"
    fi
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
    demo)
        setup notebook
        exec "$VENV/bin/purlin" demo "$@"
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
