"""All-reduce per size: Purlin's configurations against NCCL and PyTorch symmetric memory.

    python3 bench/allreduce.py [--out outputs/allreduce.json] [--ranks 2] [--quick]

On ``Cluster.best`` (fewer GPUs than ranks: virtual ranks, the baselines skipped with the
reason): the tuner's candidates of every strategy (``purlin.bench.tune``, as ``purlin tune``
times them) and the baselines at 8 KiB .. 256 MiB under CUDA graphs, then host-inclusive eager
calls at 8 and 64 KiB. Prints every point (nccl-tests table), the speed against NCCL and the
best Purlin configuration per size beside NCCL; writes the records as JSON.
"""

from __future__ import annotations

import argparse
import sys

from purlin.bench import tune
from purlin.bench.clusters import choose, describe
from purlin.bench.scripts import gpu_env, output
from purlin.bench.sweep import Sweep

KiB, MiB = 1 << 10, 1 << 20
SIZES = [8 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]
EAGER_SIZES = [8 * KiB, 64 * KiB]
BASELINES = ["nccl", "symm-one-shot", "symm-two-shot"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--candidates", type=int, default=12,
                    help="candidates per strategy and size (default 12)")
    ap.add_argument("--time-limit", type=float, default=200,
                    help="seconds for the Purlin candidates (default 200)")
    ap.add_argument("--quick", action="store_true", help="two candidates per strategy")
    ap.add_argument("--no-baselines", action="store_true")
    args = ap.parse_args()
    gpu_env()
    cluster = choose(args.ranks)
    print(f"# all-reduce {args.dtype} on the {describe(cluster)}", flush=True)
    common = dict(collectives=["all-reduce"], dtypes=[args.dtype], nranks=args.ranks,
                  cluster=cluster)
    res = Sweep(sizes=SIZES, providers=[] if args.no_baselines else BASELINES,
                **common).run(progress=False)
    timed = tune.tune(cluster, ["all-reduce"], SIZES, args.dtype,
                      limit=2 if args.quick else args.candidates, ops=50, repeats=15,
                      time_limit=args.time_limit, progress=False, log=sys.stdout)
    res = res + timed.results
    res = res + Sweep(sizes=EAGER_SIZES, mode="eager", ops=200, repeats=10,
                      providers=["purlin:auto"] + ([] if args.no_baselines else ["nccl"]),
                      **common).run(progress=False)
    res.info["script"] = "bench/allreduce.py" + (" --quick" if args.quick else "")
    res.table(file=sys.stdout)
    print()
    res.summary(file=sys.stdout)
    print()
    res.best(file=sys.stdout)
    path = output(args.out, "allreduce.json")
    res.to_json(path)
    bad = [r for r in res.records if r.wrong > 0]
    print(f"\n# {len(res.records)} records, {len(bad)} with wrong results; written {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
