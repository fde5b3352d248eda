#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels the GPU image lacks for a full GPU
# session (plotly for figures; nbclient + ipykernel + ipywidgets to execute notebooks), into
# .whl/ (git-ignored). Carry .whl with the device call; bench/gpu_session.sh installs them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "plotly>=6,<7" nbclient nbformat ipykernel ipywidgets anywidget
du -sh .whl
# the GPU image already has these (device KINDS.md): keep its versions, not a second copy
for have in attrs packaging psutil pygments python_dateutil typing_extensions narwhals; do
    rm -f .whl/${have}-*.whl
done
du -sh .whl
