"""The six-collective sweep against NCCL: latency, busbw and speed-up figures.

    python3 bench/sweep.py [--out outputs/sweep] [--quick] [--ranks 2] [--sizes 8:1GiB]

Six collectives, 8 B .. 1 GiB, Purlin (auto and strategies) against NCCL and PyTorch symmetric
memory (all-reduce), CUDA-graph replays, plus eager calls at small sizes, on ``Cluster.best``
(one GPU per rank; on fewer GPUs virtual ranks, the baselines skipped with the reason). Writes
DIR/sweep.json (records + info), DIR/sweep.html and DIR/eager.html (figures), and prints the
nccl-tests tables and the ratios against NCCL.

Budget (2xH200, under 8 minutes): baselines run first in one pair of processes; ops and
repeats shrink with the size (purlin.bench.metrics.op_counts); explicit strategies run at
every other size of the sweep (auto at all of them); ``--time-limit`` stops starting new Purlin
points after that many seconds of the graph sweep (what is left out is listed).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time

from purlin.bench.clusters import choose
from purlin.bench.scripts import folder, gpu_env
from purlin.bench.sweep import SIX, Results, Sweep
from purlin.cli import size_list

KiB, MiB = 1 << 10, 1 << 20
EAGER_SIZES = (8, 1 * KiB, 8 * KiB, 64 * KiB)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/sweep",
                    help="folder for sweep.json and the figures (default outputs/sweep)")
    ap.add_argument("--sizes", default=None, help="8:1GiB (default) or a list 8,64KiB,1MiB")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--collectives", default="all")
    ap.add_argument("--strategies", default="direct-push,two-phase,ring",
                    help="explicit Purlin strategies besides auto ('' for none)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tuning", default=None, help="tuning table (default: auto's lookup)")
    ap.add_argument("--quick", action="store_true",
                    help="a few sizes, fewer repeats: a smoke test of the whole script")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the graph sweep's Purlin points (default 400, quick 120)")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--ce", action="store_true",
                    help="also the copy-engine datapath (ce:auto) at sizes >= 1 MiB")
    args = ap.parse_args()

    gpu_env()
    args.out = str(folder(args.out))
    t0 = time.monotonic()
    if args.quick:
        sizes = size_list(args.sizes) or [8, 64 * KiB, 4 * MiB, 64 * MiB]
        ops, repeats, limit = 20, 5, args.time_limit or 120
    else:
        sizes = size_list(args.sizes) or size_list("8:1GiB")
        ops, repeats, limit = 50, 15, args.time_limit or 400
    colls = list(SIX) if args.collectives == "all" else args.collectives.split(",")
    dtypes = args.dtypes.split(",")
    strategies = [s for s in args.strategies.split(",") if s]
    every_other = sizes if args.quick or len(sizes) < 8 else sizes[::2]
    if sizes[-1] not in every_other:
        every_other = every_other + [sizes[-1]]

    cluster = choose(args.ranks)
    graph = Sweep(collectives=colls, sizes=sizes, dtypes=dtypes, mode="graph",
                  providers=["nccl", "symm-one-shot", "symm-two-shot", "purlin:auto"],
                  nranks=args.ranks, ops=ops, repeats=repeats, table=args.tuning,
                  time_limit=limit, cluster=cluster)
    # a point that never returns: `timeout`'s SIGTERM dumps every thread's stack into the log,
    # and the partial-*.json files keep the records taken before it
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    def partial(name):
        return os.path.join(args.out, f"partial-{name}.json")

    res = graph.run(progress=True, checkpoint=partial("graph"))
    spent = time.monotonic() - t0
    if strategies:
        more = Sweep(collectives=colls, sizes=every_other, dtypes=dtypes, mode="graph",
                     providers=[f"purlin:{s}" for s in strategies], nranks=args.ranks,
                     ops=ops, repeats=repeats, table=args.tuning,
                     time_limit=max(10.0, limit - spent), cluster=cluster)
        res = res + more.run(progress=True, checkpoint=partial("strategies"))
    if args.ce:
        big = [s for s in every_other if s >= (1 << 20)] or [sizes[-1]]
        ce = Sweep(collectives=colls, sizes=big, dtypes=dtypes, mode="graph",
                   providers=["ce:auto"], nranks=args.ranks, ops=ops, repeats=repeats,
                   table=args.tuning, time_limit=max(10.0, limit - (time.monotonic() - t0)),
                   cluster=cluster)
        res = res + ce.run(progress=True, checkpoint=partial("ce"))
    print(f"# graph sweep: {time.monotonic() - t0:.0f} s", flush=True)
    eager = Results([], {})
    if not args.no_eager:
        small = [s for s in EAGER_SIZES if s <= max(sizes)] or [min(sizes)]
        eager = Sweep(collectives=colls, sizes=small, dtypes=dtypes, mode="eager",
                      providers=["nccl", "purlin:auto"], nranks=args.ranks,
                      ops=100 if not args.quick else 20, repeats=5, table=args.tuning,
                      cluster=cluster).run()
        print(f"# eager sweep: {time.monotonic() - t0:.0f} s", flush=True)

    everything = res + eager
    everything.info["seconds"] = round(time.monotonic() - t0, 1)
    everything.info["script"] = "bench/sweep.py" + (" --quick" if args.quick else "")
    path = os.path.join(args.out, "sweep.json")
    everything.to_json(path)
    try:
        res.write_html(os.path.join(args.out, "sweep.html"))
        if eager.records:
            eager.write_html(os.path.join(args.out, "eager.html"))
        figures = "sweep.html, eager.html"
    except Exception as exc:  # no plotly on the GPU machine: draw from the JSON elsewhere
        figures = f"no figures ({exc}); later: purlin bench --load {path} --html sweep.html"
    everything.table(file=sys.stdout)
    print()
    everything.summary(file=sys.stdout)
    print()
    res.best(file=sys.stdout)
    bad = [r for r in everything.records if r.wrong > 0]
    print(f"\n# {len(everything.records)} records, {len(everything.errors)} failed, "
          f"{len(bad)} with wrong results; {everything.info['seconds']:.0f} s; "
          f"written {path}; {figures}")
    for r in everything.errors[:10]:
        print(f"# failed: {r.provider} {r.collective} {r.nbytes} {r.mode}: {r.extra['error']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
