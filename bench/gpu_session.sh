#!/usr/bin/env bash
# One GPU session: environment facts, kernel self-check, GPU tests, all-reduce benchmark.
# Usage (on the GPU machine, from the repo root): bash bench/gpu_session.sh [stage ...]
# Stages: env kernels tests timeline allreduce (default: all but timeline). Logs and JSON go to $OUT (or ./out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks (plotly, ...), carried along
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env kernels tests allreduce)
for stage in "${stages[@]}"; do
    echo "=== $stage ($(date +%T))"
    case $stage in
        env)
            nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -8
            python3 -c 'import torch, numba, numpy; from numba import cuda; print("torch", torch.__version__, "numba", numba.__version__, "numpy", numpy.__version__, "gpus", torch.cuda.device_count())'
            ;;
        kernels)
            timeout 200 python3 bench/gpu_kernels_check.py --out "$OUT" > "$OUT/kernels.log" 2>&1
            echo "rc=$?"; tail -45 "$OUT/kernels.log"
            ;;
        tests)
            timeout 280 python3 -m pytest -q tests/test_gpu_sm.py -p no:cacheprovider --maxfail 8 \
                -o addopts="" --timeout 120 > "$OUT/gpu_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_tests.log" | tail -40
            ;;
        timeline)
            timeout 200 python3 bench/gpu_timeline.py --out "$OUT" > "$OUT/timeline.log" 2>&1
            echo "rc=$?"; tail -25 "$OUT/timeline.log"
            ;;
        allreduce)
            timeout 280 python3 bench/gpu_allreduce.py --out "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1
            echo "rc=$?"; tail -40 "$OUT/allreduce.log"
            ;;
    esac
done
