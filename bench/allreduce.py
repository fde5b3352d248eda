"""All-reduce per size: Purlin's configurations against NCCL and PyTorch symmetric memory.

    python3 bench/allreduce.py [--out outputs/allreduce.json] [--ranks 2] [--quick]

All in one run, CUDA graphs for everyone, plus eager host time per call, on ``Cluster.best``
(on fewer GPUs than ranks: virtual ranks, the baselines skipped with the reason). Prints the
best Purlin configuration per size next to NCCL with ratios, then every point; writes the
records as JSON.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from purlin.bench.clusters import baseline_reason, choose, describe
from purlin.bench.metrics import table
from purlin.bench.scripts import gpu_env, output, write_json
from purlin.bench.sweep import environment

KiB, MiB = 1 << 10, 1 << 20
SIZES = [8 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB]


def candidates(nbytes: int):
    """(strategy, chunks, lanes, blocks_per_lane[, options]) worth trying at this size
    (lanes x blocks within the 132 SMs); options joined by "+": a protocol ("ll": flags inside
    the data; "fused": the fused kernel, flags with a slot per block; "fused-ll": the fused
    kernel with LL transfers -- blocks None is the fused kernel's default grid) and "pdl"
    (programmatic dependent launch)."""
    if nbytes <= 64 * KiB:
        fused = [("direct-push", 1, 1, None, "fused-ll+pdl"), ("direct-push", 1, 1, None,
                                                                "fused+pdl")]
        fused += [("direct-push", 1, 1, b, "fused-ll+pdl") for b in (8, 16, 32)]
    elif nbytes <= 1 * MiB:
        fused = [("direct-push", 1, 1, b, "fused+pdl") for b in (None, 16, 64)]
        fused += [("direct-push", 1, 1, None, "fused-ll+pdl"), ("two-phase", 1, 1, 32,
                                                                "fused+pdl")]
    elif nbytes <= 16 * MiB:
        fused = [("direct-push", 1, 1, b, "fused") for b in (None, 64)]
        fused += [("two-phase", c, 1, b, "fused") for c in (1, 2) for b in (64, 128, 132)]
    else:  # 132: every SM (None: the default grid, the same above 4 MiB)
        fused = [("direct-pull", 1, 1, 128, "fused"), ("direct-push", 1, 1, 128, "fused")]
        fused += [("two-phase", c, 1, b, "fused") for c in (1, 2, 4) for b in (128, 132)]
        fused += [("direct-pull", 1, 1, 132, "fused")]
    return fused + _candidates(nbytes)


def _candidates(nbytes: int):
    if nbytes <= 8 * KiB:
        return [("direct-push", 1, 1, 1, "ll"), ("direct-push", 1, 1, 1, "pdl"),
                ("direct-push", 1, 1, 1, "ll+pdl"), ("direct-push", 1, 1, 1),
                ("direct-push", 1, 1, 2), ("direct-pull", 1, 1, 1), ("two-phase", 1, 1, 1),
                ("two-phase", 1, 2, 1, "ll")]
    if nbytes <= 64 * KiB:  # LL with several blocks lost here: more blocks instead
        return [("direct-push", 1, 1, 8, "ll+pdl"), ("direct-push", 1, 1, 8, "pdl"),
                ("direct-push", 1, 1, 8), ("direct-push", 1, 1, 16, "pdl"),
                ("direct-push", 1, 1, 32, "pdl"), ("direct-push", 2, 2, 8, "pdl"),
                ("direct-push", 2, 2, 16, "pdl"), ("direct-push", 4, 4, 4, "pdl"),
                ("direct-push", 4, 4, 8, "pdl"), ("two-phase", 1, 2, 8, "pdl")]
    if nbytes <= 1 * MiB:
        return [("two-phase", 1, 2, 32), ("two-phase", 1, 2, 16), ("direct-push", 1, 1, 64),
                ("direct-pull", 1, 1, 64), ("ring", 1, 2, 32), ("two-phase", 2, 4, 16),
                ("direct-push", 8, 8, 1, "ll")]
    if nbytes <= 16 * MiB:
        return [("two-phase", 2, 2, 64), ("two-phase", 4, 4, 32), ("two-phase", 8, 8, 16),
                ("direct-pull", 1, 1, 128), ("direct-pull", 4, 4, 32), ("direct-push", 4, 4, 32)]
    return [("direct-pull", 4, 4, 32), ("direct-pull", 1, 1, 128), ("direct-pull", 16, 8, 16),
            ("two-phase", 4, 2, 64), ("two-phase", 8, 4, 32), ("direct-push", 8, 4, 32)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-baselines", action="store_true")
    args = ap.parse_args()
    gpu_env()

    import torch

    from purlin.atom.sm import PROTOCOLS
    from purlin.bench.providers import time_purlin
    from purlin.bench.torch_dist import run_baselines
    from purlin.spec import collectives

    n = args.ranks
    cluster = choose(n)
    info = {**environment("sm", n), "cluster": describe(cluster)}
    print(f"# {info['hardware']}, commit {info['commit'][:12]}: {info['cluster']}")
    coll = collectives.all_reduce(n)
    records, failures = [], []
    for nbytes in SIZES:
        for strategy, chunks, lanes, bpl, *opt in candidates(nbytes)[: 2 if args.quick
                                                                     else None]:
            options = opt[0] if opt else ""
            parts = options.split("+")
            protocol = next((p for p in parts if p in PROTOCOLS), "simple")
            try:
                rec = time_purlin(cluster, coll, nbytes, args.dtype, strategy, chunks, lanes,
                                  bpl, mode="graph", ops=50, repeats=15, protocol=protocol,
                                  pdl="pdl" in parts)
                records.append(rec)
                print(f"  {nbytes:>10} {strategy:>12} c{chunks} l{lanes} b{bpl} {options}: "
                      f"{rec.time_us:9.2f} us  busbw {rec.busbw_gbs:6.1f}  wrong {rec.wrong}",
                      flush=True)
            except Exception:
                failures.append({"nbytes": nbytes,
                                 "config": [strategy, chunks, lanes, bpl, options],
                                 "error": traceback.format_exc(limit=4)})
                print(f"  {nbytes:>10} {strategy} c{chunks} l{lanes} b{bpl}: FAILED\n"
                      + failures[-1]["error"], flush=True)
            torch.cuda.empty_cache()
    for nbytes in (8 * KiB, 64 * KiB):
        for protocol in ("simple", "ll", "fused-ll"):
            try:
                records.append(time_purlin(cluster, coll, nbytes, args.dtype, "direct-push", 1,
                                           1, None if protocol == "fused-ll" else 1, mode="eager",
                                           ops=200, repeats=10, protocol=protocol,
                                           pdl=protocol != "simple"))
            except Exception:
                failures.append({"nbytes": nbytes, "eager": True, "protocol": protocol,
                                 "error": traceback.format_exc(limit=4)})
    baselines, skipped = [], []
    why = baseline_reason("nccl", n, len(set(cluster.devices)))
    if why and not args.no_baselines:
        skipped.append(f"baselines: {why}")
        print(f"# skipped: baselines: {why}")
    elif not args.no_baselines:
        points = [("nccl", "all-reduce", s, args.dtype, "sum", "graph") for s in SIZES]
        points += [("nccl", "all-reduce", s, args.dtype, "sum", "eager")
                   for s in (8 * KiB, 64 * KiB)]
        points += [(p, "all-reduce", s, args.dtype, "sum", "graph")
                   for p in ("symm-one-shot", "symm-two-shot") for s in SIZES]
        baselines = run_baselines(points, world=n)
    everything = records + baselines
    print()
    print(table(everything))
    print()
    print(summary(records, baselines))
    path = write_json(output(args.out, "allreduce.json"),
                      {"info": info, "records": [r.to_dict() for r in everything],
                       "failures": failures, "skipped": skipped})
    print(f"# records: {path}")
    return 0


def summary(records, baselines) -> str:
    lines = [f"{'size':>10} {'purlin best':>34} {'us':>8} {'nccl us':>8} {'ratio':>6} "
             f"{'busbw':>6} {'nccl busbw':>10}"]
    for nbytes in SIZES:
        mine = [r for r in records if r.nbytes == nbytes and r.mode == "graph" and r.wrong == 0]
        nccl = [r for r in baselines if r.nbytes == nbytes and r.provider == "nccl"
                and r.mode == "graph"]
        if not mine:
            continue
        best = min(mine, key=lambda r: r.time_us)
        cfg = (f"{best.extra['strategy']} c{best.extra['chunks']} l{best.extra['lanes']} "
               f"b{best.extra['blocks_per_lane']}"
               + (f" {best.extra['protocol']}" if best.extra.get("protocol") else "")
               + (" pdl" if best.extra.get("pdl") else ""))
        n_us = nccl[0].time_us if nccl else float("nan")
        n_bw = nccl[0].busbw_gbs if nccl else float("nan")
        lines.append(f"{nbytes:>10} {cfg:>34} {best.time_us:8.2f} {n_us:8.2f} "
                     f"{n_us / best.time_us:6.2f} {best.busbw_gbs:6.1f} {n_bw:10.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
