#!/usr/bin/env bash
# One GPU session on 2 GPUs, stage by stage; logs and JSON go to $OUT (or ./out).
# Usage (on the GPU machine, from the repo root): bash bench/gpu_session.sh [stage ...]
#   env kernels tests allreduce      (the default set: ~5 minutes; cetests: the ce part alone;
#                                    lltests: the LL and PDL cases alone; fusedtests: the
#                                    fused kernel's, ~3.5 minutes, not part of tests)
#   timeline    measured vs predicted timelines (needs plotly: bench/gpu_wheels.sh)
#   tracecli    `purlin trace ... --measure` on the GPUs
#   ce          the copy-engine datapath: correctness, bandwidth, matmul overlap (ce1g: 1 GiB;
#               cehang: where the hang after a mixed collective comes from; ce1gprobe: the
#               1 GiB ce+sm all-reduce that stalled a sweep, with thread stacks)
#   process     purlin.torch against NCCL, and the TP=2 decoder layer (processll: with LL;
#               processzc: zero_copy, the caller's tensors used in place of staging copies;
#               processzcll: zero_copy with LL up to 4 MiB; processauto: protocol auto with
#               zero_copy, and fused-ll -- the fused kernel; tp: the decoder layer alone;
#               norm: all_reduce_add_rms_norm, the RMSNorm epilogue, test and checks;
#               inlayer: a small all-reduce's cost after the decoder's GEMV, and the floor's)
#   notebooks   01-tour and 04-benchmark executed on the GPUs (needs the wheels)
#   stagetests  the GPU tests of lanes by stage and push-pull alone (cestage: both against
#               NCCL from 64 MiB)
#   floor       hand-written one-shot all-reduce kernels (flag, LL, Lamport) at 8 KiB .. 1 MiB
#               against NCCL and Purlin's auto: what the protocol can reach without the executor
#   tune sweep  the tuning table, then the six-collective sweep against NCCL (sweepsm: no ce;
#               sweepce: the ce datapath's collectives, 1 MiB .. 1 GiB, against sm and NCCL)
# Set PURLIN_COMMIT to the commit being run (the device copy has no .git).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1  # absolute: notebook kernels start in notebooks/
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks (plotly, ...), carried along
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
process_sections() {  # NAME ARGS...: process mode's correctness, graph and latency sections
    local name=$1; shift
    timeout 150 python3 bench/process_mode_gpu.py "$@" --sections correctness,graph,latency \
        --out "$OUT/process_mode_$name.json" > "$OUT/process_$name.log" 2>&1
    echo "rc=$?"; tail -15 "$OUT/process_$name.log"
}
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
        tests)  # all but the fused kernel's (fusedtests): ~5 minutes
            timeout 400 python3 -m pytest -q tests/test_gpu_sm.py tests/test_gpu_ce.py \
                -k "not fused" -p no:cacheprovider --maxfail 8 -o addopts="" --timeout 120 \
                > "$OUT/gpu_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_tests.log" | tail -40
            ;;
        lltests)
            timeout 200 python3 -m pytest -q tests/test_gpu_sm.py -k "ll or pdl" \
                -p no:cacheprovider --maxfail 8 -o addopts="" --timeout 120 \
                > "$OUT/gpu_ll_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_ll_tests.log" | tail -30
            ;;
        fusedtests)
            timeout 300 python3 -m pytest -q tests/test_gpu_sm.py -k fused -p no:cacheprovider \
                --maxfail 8 -o addopts="" --timeout 120 > "$OUT/gpu_fused_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_fused_tests.log" | tail -30
            ;;
        cetests)
            timeout 150 python3 -m pytest -q tests/test_gpu_ce.py -p no:cacheprovider \
                -o addopts="" --timeout 60 > "$OUT/gpu_ce_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_ce_tests.log" | tail -20
            ;;
        timeline)
            timeout 200 python3 bench/gpu_timeline.py --out "$OUT" > "$OUT/timeline.log" 2>&1
            echo "rc=$?"; tail -25 "$OUT/timeline.log"
            ;;
        floor)
            timeout 240 python3 bench/gpu_floor.py --out "$OUT" > "$OUT/floor.log" 2>&1
            echo "rc=$?"; tail -12 "$OUT/floor.log"
            ;;
        tracecli)
            timeout 120 python3 -m purlin trace all-reduce -n 2 -b 1MiB --dtype bfloat16 --measure \
                --out "$OUT/trace-cli-allreduce-1MiB.html" --perfetto "$OUT/trace-cli-allreduce-1MiB.json" \
                > "$OUT/tracecli.log" 2>&1
            echo "rc=$?"; tail -15 "$OUT/tracecli.log"
            ;;
        ce)
            timeout 300 python3 bench/gpu_ce.py --out "$OUT/ce.json" > "$OUT/ce.log" 2>&1
            echo "rc=$?"; tail -30 "$OUT/ce.log"
            ;;
        cehang)
            timeout 250 python3 bench/ce_hang_probe.py --out "$OUT/cehang" --limit 55 \
                > "$OUT/cehang.log" 2>&1
            echo "rc=$?"; tail -6 "$OUT/cehang.log"
            ;;
        ce1gprobe)
            timeout 200 python3 bench/ce_hang_probe.py --out "$OUT/cehang" --variants allreduce1g \
                --stall 60 --limit 150 > "$OUT/ce1gprobe.log" 2>&1
            echo "rc=$?"; tail -4 "$OUT/ce1gprobe.log"; tail -40 "$OUT/cehang/allreduce1g.log"
            ;;
        ceprobe)
            timeout 400 python3 bench/ce_hang_probe.py --out "$OUT/ceprobe" --stall 60 \
                --limit 90 --variants ag50,ar1m-ag,ar1g-ag,sm-ag > "$OUT/ceprobe.log" 2>&1
            echo "rc=$?"; cat "$OUT/ceprobe.log"; tail -n 14 "$OUT"/ceprobe/*.log
            ;;
        ceupload)
            timeout 300 python3 bench/ce_hang_probe.py --out "$OUT/ceupload" --stall 30 \
                --limit 45 --variants ag-50,ag-50-dry,ag-50-rev,ag-20,ag-4 \
                > "$OUT/ceupload.log" 2>&1
            echo "rc=$?"; cat "$OUT/ceupload.log"; tail -n 6 "$OUT"/ceupload/*.log
            ;;
        ce1g)
            timeout 200 python3 bench/gpu_ce.py --correct-only --sizes 1GiB \
                --out "$OUT/ce_1GiB.json" > "$OUT/ce_1GiB.log" 2>&1
            echo "rc=$?"; tail -8 "$OUT/ce_1GiB.log"
            ;;
        process)
            timeout 150 python3 bench/process_mode_gpu.py --out "$OUT" > "$OUT/process.log" 2>&1
            echo "rc=$?"; tail -15 "$OUT/process.log"
            timeout 240 python3 bench/apps/tp_decoder.py --out "$OUT" > "$OUT/tp.log" 2>&1
            echo "rc=$?"; tail -20 "$OUT/tp.log"
            ;;
        processauto)  # the fused kernel in process mode: auto + zero-copy, then fused-ll
            for args in "auto_zc --protocol auto --zero-copy" "fused_ll --protocol fused-ll"; do
                set -- $args
                name=$1; shift
                timeout 200 python3 bench/process_mode_gpu.py "$@" \
                    --out "$OUT/process_mode_$name.json" > "$OUT/process_$name.log" 2>&1
                echo "rc=$?"; tail -28 "$OUT/process_$name.log"
            done
            ;;
        norm)  # all_reduce_add_rms_norm: the GPU test, then the norm section (auto, zero-copy)
            timeout 200 python3 -m pytest -q tests/test_gpu_process.py -p no:cacheprovider \
                -o addopts="" --timeout 180 > "$OUT/gpu_process_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_process_tests.log" | tail -20
            timeout 200 python3 bench/process_mode_gpu.py --zero-copy --sections norm \
                --out "$OUT/process_mode_norm.json" > "$OUT/process_norm.log" 2>&1
            echo "rc=$?"; tail -28 "$OUT/process_norm.log"
            ;;
        inlayer)  # what a small all-reduce costs after the decoder's GEMV, and why
            timeout 200 python3 bench/gpu_inlayer.py --out "$OUT" > "$OUT/inlayer.log" 2>&1
            echo "rc=$?"; tail -20 "$OUT/inlayer.log"
            ;;
        tpgrids)  # the decoder at hidden 4096 with the epilogue on blocks of 32 and 64 threads
            for g in 32 64; do
                timeout 150 python3 bench/apps/tp_decoder.py --hidden 4096 --prefill 0 \
                    --epi-grid $g --out "$OUT/tp_decoder_epi$g.json" > "$OUT/tp_epi$g.log" 2>&1
                echo "rc=$?"; tail -7 "$OUT/tp_epi$g.log"
            done
            ;;
        tp)  # the TP=2 decoder layer: NCCL against protocol auto, in place, zero-copy
            timeout 300 python3 bench/apps/tp_decoder.py --out "$OUT" > "$OUT/tp.log" 2>&1
            echo "rc=$?"; tail -16 "$OUT/tp.log"
            ;;
        processll) process_sections ll --protocol ll --max-bytes 4194304 ;;
        processzc) process_sections zc --zero-copy ;;
        processzcll) process_sections zc_ll --zero-copy --protocol ll --max-bytes 4194304 ;;
        notebooks)
            timeout 400 python3 - "$OUT" > "$OUT/notebooks.log" 2>&1 <<'PY'
import sys
from pathlib import Path

import nbformat

from purlin.notebooks import execute, notebook_paths

out = Path(sys.argv[1])
for path in notebook_paths():
    if path.name.startswith(("01-", "04-")):
        nb = execute(path, timeout=300)
        nbformat.write(nb, out / path.name.replace(".ipynb", "-2xH200.ipynb"))
        print("executed", path.name)
PY
            echo "rc=$?"; tail -10 "$OUT/notebooks.log"
            ;;
        tune)
            timeout 200 python3 bench/gpu_tune.py --time-limit 130 --out "$OUT/tune" > "$OUT/tune.log" 2>&1
            echo "rc=$?"; tail -15 "$OUT/tune.log"
            ;;
        sweep)
            timeout 330 python3 bench/gpu_sweep.py --ce --time-limit 170 \
                --sizes 8,64,512,4KiB,8KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB,1GiB --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
            echo "rc=$?"; tail -40 "$OUT/sweep.log"
            ;;
        sweepce)
            timeout 300 python3 bench/gpu_sweep.py --ce --time-limit 200 --strategies '' \
                --collectives all-reduce,all-gather,all-to-all,broadcast --no-eager \
                --sizes 1MiB,16MiB,64MiB,128MiB,256MiB,1GiB --out "$OUT/sweepce" > "$OUT/sweepce.log" 2>&1
            echo "rc=$?"; tail -40 "$OUT/sweepce.log"
            ;;
        ceconfigs)
            # reductions with copy-engine transfers pipelined over chunks (sm reduces), 64 MiB up
            timeout 200 python3 -m purlin bench all-reduce -b 64MiB,256MiB,1GiB --no-progress \
                -p nccl,purlin:auto,ce:two-phase,ce:two-phase/c2,ce:two-phase/c4,ce:two-phase/c8,ce:two-phase/c4/l2,ce:direct-pull/c4 \
                --time-limit 120 --json "$OUT/ceconfigs-allreduce.json" > "$OUT/ceconfigs.log" 2>&1
            echo "rc=$?"
            timeout 150 python3 -m purlin bench reduce -b 64MiB,256MiB,1GiB --no-progress \
                -p nccl,purlin:auto,ce:direct-push,ce:direct-push/c4,ce:direct-push/c8,ce:two-phase/c4 \
                --time-limit 90 --json "$OUT/ceconfigs-reduce.json" >> "$OUT/ceconfigs.log" 2>&1
            echo "rc=$?"; grep -v "^#  " "$OUT/ceconfigs.log" | tail -60
            ;;
        stagetests)
            timeout 200 python3 -m pytest -q tests/test_gpu_sm.py tests/test_gpu_ce.py -k "stage or push_pull" \
                -p no:cacheprovider --maxfail 8 -o addopts="" --timeout 120 \
                > "$OUT/gpu_stage_tests.log" 2>&1
            echo "rc=$?"; grep -E "passed|failed|Error|error|assert" "$OUT/gpu_stage_tests.log" | tail -20
            ;;
        cestage)
            # the copy engines and the SMs on NVLink together (push-pull), and lanes by stage
            timeout 220 python3 -m purlin bench all-reduce -b 64MiB,256MiB,1GiB --no-progress \
                -p nccl,purlin:auto,ce:push-pull/c2/l2,ce:push-pull/c4/l4,ce:push-pull/c8/l8,purlin:push-pull/c8/l8,ce:direct-push/c8/l2/stage \
                --time-limit 150 --json "$OUT/cestage-allreduce.json" > "$OUT/cestage.log" 2>&1
            echo "rc=$?"
            timeout 100 python3 -m purlin bench all-gather -b 64MiB,256MiB,1GiB --no-progress \
                -p nccl,ce:auto,ce:push-pull/c2/l2,ce:push-pull/c4/l4 \
                --time-limit 60 --json "$OUT/cestage-all-gather.json" >> "$OUT/cestage.log" 2>&1
            echo "rc=$?"
            grep -E "^ +[0-9]|^# [a-z-]+ \||x +[0-9.]+x" "$OUT/cestage.log" | tail -70
            ;;
        sweepsm)
            timeout 300 python3 bench/gpu_sweep.py --time-limit 170 \
                --sizes 8,64,512,4KiB,8KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB,1GiB --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
            echo "rc=$?"; tail -40 "$OUT/sweep.log"
            ;;
        allreduce)
            timeout 280 python3 bench/gpu_allreduce.py --out "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1
            echo "rc=$?"; tail -40 "$OUT/allreduce.log"
            ;;
    esac
done
