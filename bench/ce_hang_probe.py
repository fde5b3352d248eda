"""Reproduce and locate the ce datapath's hang after a mixed ce+sm collective (2 GPUs).

    PYTHONPATH=. python3 bench/ce_hang_probe.py --out DIR

Seen on 2 x H200 (docs/ADDING_A_DATAPATH.md): after a ce+sm all-reduce has run in a process,
the next copy-engine collective bound in it hung. This runs that sequence -- two-phase ce+sm
all-reduces timed under CUDA graphs, then direct-pull all-gathers (one lane, then four) and a
broadcast on the copy engines -- in child processes that differ in one thing each:

* ``default``: as a user runs it (``import purlin`` asks CUDA for 32 hardware queues);
* ``conn8``:   ``CUDA_DEVICE_MAX_CONNECTIONS=8``, CUDA's own default;
* ``leak``:    three more bindings kept alive after each step (their streams stay);
* ``fresh8``:  the copy collectives alone (no mixed one before them), with 8 queues.

* ``allreduce1g``: the ``ce:auto`` sweep's all-reduce points as the sweep ran them (two-phase,
  one lane, 1 MiB .. 1 GiB, 50 ops / 15 repeats): the 1 GiB one stalled a sweep.
  Not in the default set (``--variants allreduce1g``).

Found so far: with 8 queues the 1 MiB all-gather's 20-call graph hung whether or not a mixed
collective ran first; with 32 every step ran. ``CUDA_MODULE_LOADING=EAGER`` hung as the
default lazy loading did.

* ``ag-<ops>[-dry][-rev]``: the sweep's first ce all-gather (1 MiB, direct-pull) alone, in a
  graph of ``ops`` calls, first replay watched; ``dry``: captured with ``upload="dry"``;
  ``rev``: the second GPU's graph launched first.

Found on 2 x H200 (driver 13.0) at 812266a: ``ag-50`` hung in a fresh process, and so did
every ce point after it in the sweep; the GPU whose graph was launched first did its first
notify, the other GPU's graph never started (``rev`` mirrored it); ``ag-20`` and ``ag-4``
ran; ``cuGraphUpload`` before the first replay did not help; ``ag-50-dry`` -- each graph's
first launch made while every wait is released -- ran, and 20 replays after it.

A child that hangs dumps every thread's Python stack after ``--stall`` seconds (faulthandler)
and is killed at ``--limit``; the table says which variants finished, and DIR/<variant>.log
holds each child's output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {"default": {}, "conn8": {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "leak": {},
            "fresh8": {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "allreduce1g": {},
            "ag50": {}, "ar1m-ag": {}, "ar1g-ag": {}, "sm-ag": {}}
# the ce sweep (run at 39bc337) timed out on its first all-gather, right after its all-reduce
# points: which part of what ran before does it take? (sm-ag: the sweep's sm points instead)
AFTER = {"ag50": [], "ar1m-ag": [1 << 20], "ar1g-ag": [(1 << 20) << k for k in (0, 4, 6, 8, 10)],
         "sm-ag": []}
SIZE = 1 << 20


def child(variant: str, stall: float) -> int:
    import faulthandler

    faulthandler.dump_traceback_later(stall, exit=False)
    import torch

    from purlin.bench.ce import time_ce
    from purlin.runtime import Cluster
    from purlin.spec import standard

    cluster = Cluster.local(2)
    kept = []
    # (collective, strategy, bytes, chunks, lanes): the order of the runs that hung
    steps = [("all-reduce", "two-phase", SIZE, 1, 1), ("all-reduce", "two-phase", 64 * SIZE, 1, 1),
             ("all-gather", "direct-pull", SIZE, 1, 1),
             ("all-gather", "direct-pull", 64 * SIZE, 4, 4),
             ("broadcast", "direct-pull", SIZE, 1, 1)]
    ops, repeats = 20, 5
    if variant == "fresh8":
        steps = steps[2:]
    if variant.startswith("ag-"):
        steps = []
    if variant == "allreduce1g":
        steps = [("all-reduce", "two-phase", SIZE << k, 1, 1) for k in (0, 4, 8, 10)]
        ops, repeats = 50, 15
    if variant in AFTER:
        steps = [("all-reduce", "two-phase", n, 1, 1) for n in AFTER[variant]]
        ops, repeats = 50, 15
        if variant == "sm-ag":  # the sweep's sm points first (auto, the tuning table's LL/PDL)
            from purlin.bench.sweep import Sweep

            res = Sweep(collectives=["all-reduce"], sizes=[8192, 65536, SIZE, 16 * SIZE,
                                                           1024 * SIZE],
                        providers=["purlin:auto"], ops=ops, repeats=repeats,
                        cluster=cluster).run()
            print(f"{variant}: sm points {[round(r.time_us, 1) for r in res.records]}",
                  flush=True)
    for name, strategy, nbytes, chunks, lanes in steps:
        t0 = time.monotonic()
        print(f"{variant}: {name} {strategy} {nbytes} B c{chunks} l{lanes} ...", flush=True)
        rec = time_ce(cluster, standard(name, 2), nbytes, "bfloat16", strategy, chunks, lanes,
                      ops=ops, repeats=repeats)
        print(f"{variant}: {rec.time_us:.1f} us, wrong {rec.wrong}, "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        if variant == "leak":  # bindings never closed: their streams stay on the queues
            kept += [cluster.bind(standard(name, 2), strategy, nbytes=nbytes,
                                  dtype="bfloat16", chunks=chunks, lanes=lanes, datapath="ce")
                     for _ in range(3)]
    if variant in AFTER:
        watch_all_gather(torch, cluster, ops)
    if variant.startswith("ag-"):  # ag-<ops>[-dry][-rev]: the all-gather graph alone
        parts = variant.split("-")
        upload = "dry" if "dry" in parts else "none"
        watch_all_gather(torch, cluster, int(parts[1]), upload, "rev" in parts)
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    print(f"{variant}: done ({len(kept)} bindings kept alive)", flush=True)
    return 0


def watch_all_gather(torch, cluster, ops: int, upload: str = "none",
                     reverse: bool = False) -> None:
    """The sweep's first ce all-gather (1 MiB, direct-pull, one lane) under a CUDA graph of
    ``ops`` calls, watched: its counters every 0.5 s; still running after 4 s, the child says
    so and exits (a host call now could wait for ever)."""
    from purlin.atom import ce_driver as drv
    from purlin.bench.providers import count_wrong
    from purlin.spec import standard

    bound = cluster.bind(standard("all-gather", 2), "direct-pull", nbytes=SIZE,
                         dtype="bfloat16", datapath="ce")
    print(f"all-gather eager: wrong {count_wrong(torch, bound)}", flush=True)
    graphs = bound.capture(ops, upload=upload)
    print(f"captured {ops} calls (upload {upload}); replaying once"
          f"{', second GPU first' if reverse else ''}", flush=True)
    for d, graph in (reversed(graphs.graphs) if reverse else graphs.graphs):
        with torch.cuda.device(d):
            graph.replay()
    bound.calls += ops
    deadline = time.monotonic() + 4.0
    while not bound._wait_idle(drv, time.monotonic() + 0.5):
        values = bound._read_counters()
        print("  counters:", [[int(x) for x in v] for _, v in values] if values
              else "unreadable", flush=True)
        if time.monotonic() > deadline:
            print("all-gather graph: STUCK", flush=True)
            os._exit(3)
    bound.check()
    rec_wrong = count_wrong(torch, bound)
    for _ in range(20):
        graphs.replay()
    bound.check()
    print(f"all-gather graph: finished; 20 more replays finished; eager after: wrong "
          f"{rec_wrong}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--stall", type=float, default=30.0, help="seconds before a stack dump")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds before a child is killed")
    ap.add_argument("--variants", default="default,conn8,leak,fresh8",
                    help=f"comma-separated, of {', '.join(VARIANTS)}, or "
                    "ag-<ops>[-dry][-rev] (the all-gather graph alone)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.stall)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for variant in args.variants.split(","):
        env = VARIANTS.get(variant, {})
        t0 = time.monotonic()
        log = out / f"{variant}.log"
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, __file__, "--child", variant, "--stall",
                                     str(args.stall)], env={**os.environ, **env}, stdout=f,
                                    stderr=subprocess.STDOUT, timeout=args.limit).returncode
                state = "finished" if rc == 0 else f"failed (rc {rc})"
            except subprocess.TimeoutExpired:
                state = f"hung (killed after {args.limit:.0f} s)"
        results[variant] = {"state": state, "seconds": round(time.monotonic() - t0, 1)}
        print(f"{variant:>6}: {state}, {results[variant]['seconds']} s; {log}", flush=True)
    (out / "ce_hang_probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
