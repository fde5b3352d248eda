#!/usr/bin/env bash
# Runs the bench/ scripts, the GPU tests and the CLI on a GPU machine, stage by stage; every
# stage is bounded by `timeout` and writes its log (and JSON) under $OUT (default ./out).
#
#   bash bench/gpu_session.sh [--limit SECONDS] [--dry-run] stage ...
#
# --limit S  the whole session under S seconds; the stages write into a scratch folder that is
#            packed into $OUT/session.tgz at the end (also when the limit cut it short), beside
#            $OUT/session.log (a device call brings back only a few files)
# --dry-run  print each stage's commands instead of running them
#
# One GPU (virtual ranks): one-gpu = env imports cli1 notebooks1 custom fusedtrace fp8det varlen
#                          epilogues vtests
#   env         nvidia-smi -L, the versions of python, torch, numba, numpy, the GPUs torch sees
#   imports     purlin.kernels imported three ways (PYTHONPATH=. from the checkout, installed
#               with pip --target, editable in a venv), each printing where purlin.kernels.isa is
#   vtests      every gpu-marked test; on one GPU the tests that need one GPU per rank skip (-rs
#               lists why) and the virtual-rank ones run
#   cli1        purlin bench / run / trace --measure on 4 ranks (virtual on one GPU)
#   notebooks1  notebooks/0*.ipynb executed headless (needs the wheels of bench/wheels.sh);
#               executed copies and each notebook's error outputs under $OUT
#   custom      bench/custom_vs_standard.py at 4 and 8 ranks, where the script exists
#   demo1       `purlin demo --gpu` (not in one-gpu: notebooks1 runs the same tour)
#   tune1       `purlin tune` on 4 and 8 virtual ranks (8 KiB .. 16 MiB, ~4 minutes) into
#               $OUT/tuning.json, which `auto` in every later stage reads ($PURLIN_TUNING);
#               copy it to purlin/runtime/tuning/<gpu>.json to keep it
# Two GPUs and more: two-gpu = env tests allreduce
#   tests lltests fusedtests cetests stagetests norm   GPU tests (parts of them)
#   allreduce sweep sweepsm sweepce tune               bench/allreduce.py, bench/sweep.py, tune
#   ce ce1g ceconfigs cestage                          the copy-engine datapath
#   process processll processzc processzcll processauto tp tpgrids inlayer
#                                                      bench/process_mode.py, tp_decoder, inlayer
#   timeline tracecli notebooks                        timelines, `purlin trace`, notebooks
# Either (one GPU is enough):
#   fusedtrace   bench/timelines.py --fused: the fused kernel traced vs untraced, its timelines
#   lanes        a program a lane: its GPU tests, then the two-root broadcast's rows of
#                bench/custom_vs_standard.py (direct-pull with 2 lanes beside the one-lane binds)
#   fp8det       bench/fp8_deterministic.py: FP8 vs bf16 all-gathers, deterministic all-reduces
#   varlen       bench/moe.py (the MoE layer) and bench/all_to_all_v.py (skewed device counts)
#   epilogues    bench/epilogues.py: user epilogues fused vs unfused, the built-in generic vs hand
#   versions     bench/versions.py: the standard collectives, this tree against BEFORE=<tree>
#                (git archive <rev> | tar -x -C <tree>), alternating in one run; with
#                CASES=gqa,broadcast the custom cases of that name and their twins, two rounds
#   peers                                              bench/peers.py: every peer beside Purlin
#                                                      in one run, ~9 minutes (FlashInfer from
#                                                      .whl: bash bench/wheels.sh --peers)
# Set PURLIN_COMMIT to the commit being run (the device copy has no .git).
set -uo pipefail
limit="" dry=0 stages=()
while [ $# -gt 0 ]; do
    case $1 in
        --limit) limit=$2; shift 2 ;;
        --limit=*) limit=${1#--limit=}; shift ;;
        --dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"; exit 0 ;;
        *) stages+=("$1"); shift ;;
    esac
done
[ ${#stages[@]} -eq 0 ] && stages=(two-gpu)
expanded=()
for s in "${stages[@]}"; do
    case $s in
        one-gpu) expanded+=(env imports cli1 notebooks1 custom fusedtrace fp8det varlen epilogues
                          vtests) ;;
        two-gpu) expanded+=(env tests allreduce) ;;
        *) expanded+=("$s") ;;
    esac
done
stages=("${expanded[@]}")

if [ -n "$limit" ] && [ "$dry" = 0 ]; then  # the packing wrapper: run again under the limit
    back=${OUT:-out}
    scratch=/tmp/purlin-session
    rm -rf "$scratch" && mkdir -p "$scratch" "$back"
    OUT=$scratch timeout --kill-after=10 "$limit" bash "$0" "${stages[@]}" 2>&1 \
        | tee "$scratch/session.log"
    if [ -f "$scratch/.running" ]; then  # the stage the limit cut short, with its children
        group=$(cat "$scratch/.running")
        rm -f "$scratch/.running"
        kill -TERM -- "-$group" 2>/dev/null && sleep 5 && kill -KILL -- "-$group" 2>/dev/null
        echo "=== the limit of $limit s stopped the running stage (process group $group)" \
            | tee -a "$scratch/session.log"
    fi
    cp "$scratch/session.log" "$back/session.log"
    tar czf "$back/session.tgz" -C "$scratch" .
    ls -la "$back"
    exit 0
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: some stages run from another folder
ROOT=$PWD
site=/tmp/site  # wheels the image lacks (plotly, nbclient, ...), carried in .whl/
if [ "$dry" = 0 ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d "$site/plotly" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # absolute: notebook kernels start elsewhere
[ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"

step() {  # NAME SECONDS CMD...: CMD under timeout into $OUT/NAME.log; rc and the log's tail
    local name=$1 secs=$2; shift 2
    if [ "$dry" = 1 ]; then
        local shown=() a
        for a in "$@"; do [[ $a == *$'\n'* ]] && shown+=("<inline python>") || shown+=("$a"); done
        echo "  timeout $secs ${shown[*]} > \$OUT/$name.log"
        return 0
    fi
    # in the background so that its id is known: `timeout` leads a process group of its own,
    # which --limit stops if the session's time runs out in the middle of this stage
    timeout --kill-after=5 "$secs" "$@" > "$OUT/$name.log" 2>&1 &
    local pid=$!
    echo "$pid" > "$OUT/.running"
    wait "$pid"
    local rc=$?
    rm -f "$OUT/.running"
    echo "rc=$rc ($name)"
    tail -n "${TAIL:-15}" "$OUT/$name.log"
    return $rc
}
pytest_gpu() {  # NAME SECONDS PER_TEST PYTEST_ARGS...
    local name=$1 secs=$2 per=$3; shift 3
    TAIL=${TAIL:-30} step "$name" "$secs" python3 -m pytest -q -rs -p no:cacheprovider \
        -o addopts="" --timeout "$per" "$@"
}
process_sections() {  # NAME ARGS...: process mode's correctness, graph and latency sections
    local name=$1; shift
    step "process_$name" 150 python3 bench/process_mode.py "$@" \
        --sections correctness,graph,latency --out "$OUT/process_mode_$name.json"
}

# the import, three ways, each from outside the checkout
IMPORT_CHECK='import purlin, purlin.kernels.isa as isa; print(purlin.__file__, isa.__file__)'
imports() {
    echo "-- PYTHONPATH=. from the checkout"
    (cd "$ROOT" && PYTHONPATH=. python3 -c "$IMPORT_CHECK")
    echo "-- pip install --target /tmp/inst"
    rm -rf /tmp/inst
    python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/inst \
        "$ROOT" && (cd /tmp && PYTHONPATH=/tmp/inst python3 -c "$IMPORT_CHECK")
    echo "-- editable install in a venv (/tmp/ev)"
    rm -rf /tmp/ev
    # the image's python3 is itself a venv: its site-packages (torch, numba, pip) reach the new
    # venv through a .pth file, as --system-site-packages would from a system python
    python3 -m venv --without-pip --system-site-packages /tmp/ev \
        && python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
            > "$(echo /tmp/ev/lib/python3*/site-packages)/_image.pth" \
        && (cd "$ROOT" && env -u PYTHONPATH /tmp/ev/bin/python -m pip install -q --no-deps \
            --no-build-isolation --no-cache-dir -e .) \
        && (cd /tmp && env -u PYTHONPATH /tmp/ev/bin/python -c "$IMPORT_CHECK")
}

# the executed notebooks' name tag: GPU count and model, "1xH100"
gpu_tag() {
    python3 -c 'import torch; print(f"{torch.cuda.device_count()}x"
                + torch.cuda.get_device_name(0).split()[1])' 2>/dev/null || echo gpu
}

NOTEBOOKS_PY='
import sys
from pathlib import Path

import nbclient
import nbformat

from purlin.notebooks import notebook_paths

out, tag, only = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
bad = 0
for path in notebook_paths():
    if only and not path.name.startswith(tuple(only)):
        continue
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except Exception as exc:  # a cell past its time, a dead kernel
        print(f"{path.name}: stopped: {type(exc).__name__}: {str(exc)[:600]}")
        bad += 1
    errors = [(i, o.get("ename"), str(o.get("evalue"))[:400]) for i, c in enumerate(nb.cells)
              for o in c.get("outputs", ()) if o.get("output_type") == "error"]
    nbformat.write(nb, out / path.name.replace(".ipynb", f"-{tag}.ipynb"))
    bad += bool(errors)
    print(f"{path.name}: " + ("no error output" if not errors else
                              "ERRORS " + "; ".join(f"cell {i}: {n}: {v}" for i, n, v in errors)))
sys.exit(1 if bad else 0)
'

for stage in "${stages[@]}"; do
    echo "=== $stage ($(date +%T))"
    case $stage in
        env)
            if [ "$dry" = 1 ]; then echo "  nvidia-smi -L; python3 -c <versions>"; continue; fi
            nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -8
            python3 -c 'import sys, torch, numba, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numba", numba.__version__, "numpy", numpy.__version__, "gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())])' 2>&1 | tee "$OUT/env.log"
            ;;
        imports)
            if [ "$dry" = 1 ]; then
                echo "  PYTHONPATH=. python3 -c '$IMPORT_CHECK'"
                echo "  pip install --no-deps --no-build-isolation --target /tmp/inst . ; cd /tmp; PYTHONPATH=/tmp/inst python3 -c ..."
                echo "  python3 -m venv --without-pip --system-site-packages /tmp/ev (+ .pth); /tmp/ev/bin/python -m pip install --no-deps --no-build-isolation -e . ; cd /tmp; /tmp/ev/bin/python -c ..."
                continue
            fi
            export ROOT IMPORT_CHECK
            export -f imports
            TAIL=20 step imports 180 bash -c imports
            ;;
        vtests)  # on one GPU the local-cluster tests skip with their reason
            pytest_gpu gpu_tests_virtual 540 300 --maxfail 10 -m gpu tests
            ;;
        cli1)
            run_gpu="--datapath sm"  # the run command's GPU switch, whichever this tree has
            [ "$dry" = 0 ] && python3 -m purlin run --help 2>/dev/null | grep -q -- "--gpu" \
                && run_gpu="--gpu"
            step cli_bench 200 python3 -m purlin bench all-reduce -n 4 -b 8KiB:1MiB \
                --no-progress --json "$OUT/cli_bench.json"
            step cli_run 100 python3 -m purlin run all-reduce -n 4 $run_gpu -b 1MiB \
                --dtype bfloat16
            step cli_trace 120 python3 -m purlin trace all-reduce -n 4 -b 1MiB --dtype bfloat16 \
                --measure --out "$OUT/trace-4ranks-1MiB.html" \
                --perfetto "$OUT/trace-4ranks-1MiB.json"
            ;;
        notebooks1)
            # NOTEBOOKS="03 06" runs only the notebooks whose names start so
            TAIL=12 step notebooks_1gpu 400 python3 -c "$NOTEBOOKS_PY" "$OUT" "$(gpu_tag)" ${NOTEBOOKS:-}
            ;;
        demo1)  # `purlin demo --gpu`: the tour on the best cluster here (virtual ranks on one GPU)
            TAIL=25 step demo_gpu 200 python3 -m purlin demo --gpu --out "$OUT/demo"
            ;;
        notebooks)
            TAIL=12 step notebooks 400 python3 -c "$NOTEBOOKS_PY" "$OUT" "$(gpu_tag)" 01- 04-
            ;;
        custom)
            if [ -f bench/custom_vs_standard.py ]; then
                TAIL=60 step custom 240 python3 bench/custom_vs_standard.py --ranks 4,8 \
                    --out "$OUT/custom.json"
            else
                echo "bench/custom_vs_standard.py is not in this tree: skipped"
            fi
            ;;
        lanes)
            pytest_gpu gpu_lanes_tests 200 120 tests/test_gpu_sm.py -k "lanes"
            TAIL=30 step custom_lanes 200 python3 bench/custom_vs_standard.py --ranks 4,8 \
                --cases two-root --out "$OUT/custom_lanes.json"
            ;;
        tests)  # all but the fused kernel's (fusedtests): ~5 minutes
            pytest_gpu gpu_tests 400 120 --maxfail 8 tests/test_gpu_sm.py tests/test_gpu_ce.py \
                -k "not fused"
            ;;
        lltests) pytest_gpu gpu_ll_tests 200 120 --maxfail 8 tests/test_gpu_sm.py -k "ll or pdl" ;;
        fusedtests) pytest_gpu gpu_fused_tests 300 120 --maxfail 8 tests/test_gpu_sm.py -k fused ;;
        cetests) pytest_gpu gpu_ce_tests 150 60 tests/test_gpu_ce.py ;;
        stagetests)
            pytest_gpu gpu_stage_tests 200 120 --maxfail 8 tests/test_gpu_sm.py \
                tests/test_gpu_ce.py -k "stage or push_pull"
            ;;
        norm)  # all_reduce_add_rms_norm: the GPU test, then the norm section (auto, zero-copy)
            pytest_gpu gpu_process_tests 200 180 tests/test_gpu_process.py
            TAIL=28 step process_norm 200 python3 bench/process_mode.py --zero-copy \
                --sections norm --out "$OUT/process_mode_norm.json"
            ;;
        timeline) TAIL=25 step timeline 200 python3 bench/timelines.py --out "$OUT/timelines" ;;
        fusedtrace)  # the fused kernel traced against untraced, and its timelines
            TAIL=25 step fused_timelines 200 python3 bench/timelines.py --fused \
                --out "$OUT/timelines"
            ;;
        fp8det)  # FP8 against bfloat16 all-gathers, deterministic against default all-reduces
            TAIL=40 step fp8_deterministic 240 python3 bench/fp8_deterministic.py --ranks 4,8 \
                --out "$OUT/fp8_deterministic.json"
            ;;
        epilogues)  # user epilogues fused vs unfused; the built-in through the generic kernel
            TAIL=40 step epilogues 300 python3 bench/epilogues.py --batch 1 8 32 64 \
                --out "$OUT/epilogues.json" ;;
        versions)
            if [ -n "${BEFORE:-}" ]; then
                TAIL=40 step versions 420 python3 bench/versions.py --before "$BEFORE" \
                    --ranks 4,8 ${CASES:+--cases "$CASES" --rounds 2} --out "$OUT/versions.json"
            else
                echo "versions: set BEFORE to the source tree to compare against: skipped"
            fi
            ;;
        varlen)  # the MoE layer, then all_to_all_v with skewed device counts
            TAIL=8 step moe 150 python3 bench/moe.py --datapath sm --out "$OUT"
            TAIL=40 step all_to_all_v 240 python3 bench/all_to_all_v.py --ranks 4,8 --out "$OUT"
            ;;
        tracecli)
            step tracecli 120 python3 -m purlin trace all-reduce -n 2 -b 1MiB --dtype bfloat16 \
                --measure --out "$OUT/trace-cli-allreduce-1MiB.html" \
                --perfetto "$OUT/trace-cli-allreduce-1MiB.json"
            ;;
        ce) TAIL=30 step ce 300 python3 bench/ce.py --out "$OUT/ce.json" ;;
        ce1g)
            TAIL=8 step ce_1GiB 200 python3 bench/ce.py --correct-only --sizes 1GiB \
                --out "$OUT/ce_1GiB.json"
            ;;
        process)
            step process 150 python3 bench/process_mode.py --out "$OUT/process_mode.json"
            TAIL=20 step tp 240 python3 bench/tp_decoder.py --out "$OUT/tp_decoder.json"
            ;;
        processauto)  # the fused kernel in process mode: auto + zero-copy, then fused-ll
            TAIL=28 step process_auto_zc 200 python3 bench/process_mode.py --protocol auto \
                --zero-copy --out "$OUT/process_mode_auto_zc.json"
            TAIL=28 step process_fused_ll 200 python3 bench/process_mode.py \
                --protocol fused-ll --out "$OUT/process_mode_fused_ll.json"
            ;;
        inlayer) TAIL=20 step inlayer 200 python3 bench/inlayer.py --out "$OUT/inlayer.json" ;;
        tpgrids)  # the decoder at hidden 4096 with the epilogue on blocks of 32 and 64 threads
            for g in 32 64; do
                TAIL=7 step "tp_epi$g" 150 python3 bench/tp_decoder.py --hidden 4096 \
                    --prefill 0 --epi-grid $g --out "$OUT/tp_decoder_epi$g.json"
            done
            ;;
        tp) TAIL=16 step tp 300 python3 bench/tp_decoder.py --out "$OUT/tp_decoder.json" ;;
        processll) process_sections ll --protocol ll --max-bytes 4194304 ;;
        processzc) process_sections zc --zero-copy ;;
        processzcll) process_sections zc_ll --zero-copy --protocol ll --max-bytes 4194304 ;;
        tune)
            step tune 200 python3 -m purlin tune --time-limit 130 --no-progress \
                --out "$OUT/tuning.json" --json "$OUT/tune_candidates.json"
            ;;
        tune1)  # a virtual-rank table of the GPU at hand; the stages after it use it
            for n in 4 8; do
                TAIL=26 step "tune$n" 150 python3 -m purlin tune -n "$n" \
                    -b 8KiB,64KiB,1MiB,16MiB --time-limit 95 --no-progress \
                    --out "$OUT/tuning.json" --json "$OUT/tune${n}_candidates.json"
            done
            [ "$dry" = 0 ] && [ -f "$OUT/tuning.json" ] && export PURLIN_TUNING="$OUT/tuning.json"
            ;;
        sweep)
            TAIL=40 step sweep 330 python3 bench/sweep.py --ce --time-limit 170 \
                --sizes 8,64,512,4KiB,8KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB,1GiB \
                --out "$OUT/sweep"
            ;;
        sweepsm)
            TAIL=40 step sweep 300 python3 bench/sweep.py --time-limit 170 \
                --sizes 8,64,512,4KiB,8KiB,32KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB,1GiB \
                --out "$OUT/sweep"
            ;;
        sweepce)
            TAIL=40 step sweepce 300 python3 bench/sweep.py --ce --time-limit 200 --strategies '' \
                --collectives all-reduce,all-gather,all-to-all,broadcast --no-eager \
                --sizes 1MiB,16MiB,64MiB,128MiB,256MiB,1GiB --out "$OUT/sweepce"
            ;;
        ceconfigs)  # reductions with copy-engine transfers pipelined over chunks, 64 MiB up
            TAIL=40 step ceconfigs_allreduce 200 python3 -m purlin bench all-reduce \
                -b 64MiB,256MiB,1GiB --no-progress --time-limit 120 \
                -p nccl,purlin:auto,ce:two-phase,ce:two-phase/c2,ce:two-phase/c4,ce:two-phase/c8,ce:two-phase/c4/l2,ce:direct-pull/c4 \
                --json "$OUT/ceconfigs-allreduce.json"
            TAIL=40 step ceconfigs_reduce 150 python3 -m purlin bench reduce \
                -b 64MiB,256MiB,1GiB --no-progress --time-limit 90 \
                -p nccl,purlin:auto,ce:direct-push,ce:direct-push/c4,ce:direct-push/c8,ce:two-phase/c4 \
                --json "$OUT/ceconfigs-reduce.json"
            ;;
        cestage)  # the copy engines and the SMs on NVLink together (push-pull), lanes by stage
            TAIL=40 step cestage_allreduce 220 python3 -m purlin bench all-reduce \
                -b 64MiB,256MiB,1GiB --no-progress --time-limit 150 \
                -p nccl,purlin:auto,ce:push-pull/c2/l2,ce:push-pull/c4/l4,ce:push-pull/c8/l8,purlin:push-pull/c8/l8,ce:direct-push/c8/l2/stage \
                --json "$OUT/cestage-allreduce.json"
            TAIL=40 step cestage_all_gather 100 python3 -m purlin bench all-gather \
                -b 64MiB,256MiB,1GiB --no-progress --time-limit 60 \
                -p nccl,ce:auto,ce:push-pull/c2/l2,ce:push-pull/c4/l4 \
                --json "$OUT/cestage-all-gather.json"
            ;;
        peers) TAIL=150 step peers 570 python3 bench/peers.py --out "$OUT/peers" ;;
        allreduce) TAIL=40 step allreduce 280 python3 bench/allreduce.py --out "$OUT/allreduce.json" ;;
        *) echo "unknown stage $stage (see the head of bench/gpu_session.sh)" ;;
    esac
done
