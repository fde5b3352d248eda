"""Tune strategy="auto" on 2 GPUs: time candidate configurations of the six collectives at a
handful of sizes and write the tuning table where auto.py reads it
(purlin/runtime/tuning/<gpu-name>.json, merged with what is there), plus a copy and every
timed candidate into DIR.

    PYTHONPATH=. python3 bench/gpu_tune.py --out DIR [--quick] [--time-limit 240] [--limit 8]
        [--sizes 8KiB,64KiB,1MiB,16MiB,64MiB,256MiB] [--collectives all]

Budget: under 5 minutes on 2xH200 (the time limit is shared equally among the points still to
tune; every point times the first candidate of each strategy whatever the limit).
Commit the table: cp DIR/<gpu-name>.json purlin/runtime/tuning/
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

from purlin.bench.sweep import SIX  # noqa: E402
from purlin.cli import size_list  # noqa: E402

SIZES = "8KiB,64KiB,1MiB,16MiB,64MiB,256MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--collectives", default="all")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8, help="candidates per strategy")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds (default 240)")
    ap.add_argument("--quick", action="store_true", help="2 sizes, 2 candidates per strategy")
    ap.add_argument("--table", default=None,
                    help="where to write the table (default: where auto.py looks)")
    args = ap.parse_args()

    from purlin.bench.tune import tune
    from purlin.runtime import Cluster
    from purlin.runtime.auto import TuningTable, slug, tuning_path

    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    sizes = size_list("64KiB,64MiB" if args.quick and args.sizes == SIZES else args.sizes)
    colls = list(SIX) if args.collectives == "all" else args.collectives.split(",")
    cluster = Cluster.local(args.ranks)
    result = tune(cluster, colls, sizes, args.dtype, limit=2 if args.quick else args.limit,
                  time_limit=args.time_limit or (90 if args.quick else 240), progress=True,
                  log=sys.stdout)
    table = result.table
    path = tuning_path(table.gpu) if args.table is None else args.table
    if os.path.exists(path):
        table = TuningTable.load(path).merge(table)
    saved = table.save(path)
    copy = os.path.join(args.out, f"{slug(table.gpu)}.json")
    shutil.copyfile(saved, copy)
    result.results.to_json(os.path.join(args.out, "tune_candidates.json"))
    res = result.results
    failed = [r for r in res.records if not r.ok]
    wrong = [r for r in res.records if r.wrong > 0]
    print(f"\n# {len(res.records)} candidates timed, {len(failed)} failed, {len(wrong)} wrong; "
          f"{time.monotonic() - t0:.0f} s")
    for r in failed[:8]:
        print(f"# failed: {r.collective} {r.nbytes} {r.extra.get('strategy')} "
              f"c{r.extra.get('chunks')} l{r.extra.get('lanes')} "
              f"b{r.extra.get('blocks_per_lane')}: {r.extra.get('error')}")
    print(f"# tuning table ({table.gpu}, {args.ranks} ranks): {saved}; copy: {copy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
