#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels the GPU image lacks for a full GPU
# session (plotly for figures; nbclient + ipykernel + ipywidgets to execute notebooks), into
# .whl/ (git-ignored). Carry .whl with the device call; bench/gpu_session.sh installs them.
#
#   bash bench/wheels.sh            the session's wheels
#   bash bench/wheels.sh --peers    also FlashInfer for bench/peers.py: flashinfer-python 0.7.4
#                                   stripped to flashinfer.comm and the JIT sources and headers
#                                   of its all-reduce kernels (purlin.bench.peers.strip_flashinfer:
#                                   101 MB -> ~8 MB; the image's nvcc compiles them on first
#                                   use), and apache-tvm-ffi, the one package it needs for them
#                                   that the image lacks (~3 MB)
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
if [ "${1:-}" = "--peers" ]; then
    # FlashInfer's other requirements are on the image (torch, numpy, ninja, einops, click,
    # tabulate, tqdm, requests, nvidia-ml-py, cuda-bindings) or unused by these kernels
    # (nvidia-cutlass-dsl, nvidia-cudnn-frontend, nccl4py, nccl-extensions, cuda-tile)
    scratch=$(mktemp -d)
    python3 -m pip download -q --no-deps -d "$scratch" "flashinfer-python==0.7.4"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
        "apache-tvm-ffi>=0.1.11,<0.2"
    rm -f .whl/flashinfer_python-*.whl
    PYTHONPATH=. python3 -c 'import sys; from purlin.bench.peers import strip_flashinfer
print(strip_flashinfer(sys.argv[1], ".whl"))' "$scratch"/flashinfer_python-*.whl
    rm -rf "$scratch"
    du -sh .whl
fi
