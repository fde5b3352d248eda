"""What ``purlin bench`` and ``purlin tune`` do once the command line is parsed (purlin/cli.py
declares their arguments and calls these)."""

from __future__ import annotations

import sys
from pathlib import Path

from purlin.bench.sweep import SIX, Results, Sweep, powers_of_two

GPU_PROVIDERS = "purlin:auto,nccl"
HOST_PROVIDERS = "purlin:auto,purlin:direct-push,purlin:two-phase,purlin:ring"
CPU_MAX_BYTES = 16 << 20
TUNE_SIZES = (8 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)


def gpu_count() -> int:
    from purlin.bench import clusters

    return clusters.gpu_count()


def collectives_from(names) -> list[str]:
    names = list(names or ["all-reduce"])
    return list(SIX) if names == ["all"] else names


def bench(args, sizes) -> int:
    """``purlin bench``: ``sizes`` is the parsed size list (None: the datapath's default)."""
    if args.load:
        return report(Results.load(args.load), args.json, args.html)
    gpus = gpu_count()
    if args.predict:
        datapath = "model"
    elif args.datapath:
        datapath = args.datapath
    elif gpus >= 1:  # one GPU runs the sm datapath too, on virtual ranks
        datapath = "sm"
    else:
        datapath = "cpu"
        print("purlin bench: no CUDA GPU is visible here; running the cpu datapath (numpy, "
              "host threads): its times are NOT GPU numbers. Use --predict for the cost "
              "model's predicted GPU times.", file=sys.stderr)
    if datapath == "sm" and gpus < 1:
        print("purlin bench: --datapath sm needs GPUs; none is visible here (try --predict "
              "or --datapath cpu)", file=sys.stderr)
        return 1
    if sizes is None:
        sizes = powers_of_two(8, 64 << 10 if datapath == "cpu" else 1 << 30)
    if datapath == "cpu" and max(sizes) > CPU_MAX_BYTES:
        print(f"purlin bench: the cpu datapath runs sizes up to {CPU_MAX_BYTES >> 20} MiB; "
              "larger ones are left out", file=sys.stderr)
        sizes = [s for s in sizes if s <= CPU_MAX_BYTES] or [CPU_MAX_BYTES]
    dtypes = (args.dtype or ("float32" if datapath == "cpu" else "bfloat16")).split(",")
    providers = (args.providers or (GPU_PROVIDERS if datapath == "sm" else HOST_PROVIDERS))
    nranks = args.ranks or (max(2, gpus) if datapath == "sm" else 2)
    cluster = None
    if datapath == "sm":
        from purlin.bench import clusters

        cluster = clusters.choose(nranks)
        print(f"purlin bench: {clusters.describe(cluster)}", file=sys.stderr)
    sweep = Sweep(collectives=collectives_from(args.collectives), sizes=sizes, dtypes=dtypes,
                  providers=[p for p in providers.split(",") if p], mode=args.mode,
                  nranks=nranks, datapath=datapath, cluster=cluster,
                  op=args.op or "sum", ops=args.ops, repeats=args.repeats,
                  profile=args.profile, table=args.tuning, time_limit=args.time_limit)
    res = sweep.run(progress=not args.no_progress)
    return report(res, args.json, args.html)


def report(res: Results, json_path=None, html_path=None, file=None) -> int:
    """Print the table (and the summary against NCCL when there is one), write the files;
    exit code 1 if any point was wrong or failed."""
    file = file or sys.stdout
    res.table(file=file)
    if any(r.provider == "nccl" for r in res.records):
        print(file=file)
        res.summary(file=file)
    if json_path:
        res.to_json(json_path)
        print(f"# records: {json_path}", file=file)
    if html_path:
        res.write_html(html_path)
        print(f"# figures: {html_path}", file=file)
    bad = [r for r in res.records if r.wrong > 0]
    if bad:
        print(f"purlin bench: {len(bad)} point(s) computed WRONG results", file=sys.stderr)
    if res.errors:
        print(f"purlin bench: {len(res.errors)} point(s) failed; first: "
              f"{res.errors[0].extra['error']}", file=sys.stderr)
    return 1 if bad or res.errors else 0


def tune(args, sizes) -> int:
    """``purlin tune``: list candidates (no GPU needed) or measure and write the table."""
    from purlin.bench import tune as tuning
    from purlin.runtime.auto import tuning_path

    sizes = sizes or list(TUNE_SIZES)
    names = collectives_from(args.collectives or ["all"])
    if args.list:
        colls = Sweep(collectives=names, nranks=args.ranks or 2, datapath="cpu",
                      providers=["purlin:auto"]).built()
        budget = tuning.sm_budget(args.sms, args.threads)
        print(f"# candidates within the SM budget of {budget} blocks per rank "
              f"({args.sms} SMs, {args.threads} threads per block), most plausible first")
        for c in colls:
            for s in sizes:
                cands = tuning.candidates(c, s, args.dtype, sms=args.sms, threads=args.threads,
                                          limit=args.limit)
                print(f"{c.name:>15} {s:>11} B  {len(cands):>3}: "
                      + ", ".join(map(repr, cands)))
        return 0
    gpus = gpu_count()
    n = args.ranks or gpus
    if gpus < 1 or n < 2:
        print(f"purlin tune: measuring needs GPUs ({gpus} visible, {n} ranks); "
              "`purlin tune --list` shows the candidates without one", file=sys.stderr)
        return 1
    from purlin.bench import clusters

    cluster = clusters.choose(n)
    print(f"# {clusters.describe(cluster)}")
    result = tuning.tune(cluster, names, sizes, args.dtype, limit=args.limit,
                         threads=args.threads, time_limit=args.time_limit,
                         progress=not args.no_progress, log=sys.stdout)
    table = result.table
    path = Path(args.out) if args.out else tuning_path(table.gpu)
    if not args.replace and path.exists():
        from purlin.runtime.auto import TuningTable

        table = TuningTable.load(path).merge(table)
    saved = table.save(path)
    print(f"# tuning table for {table.gpu}, {n} ranks: {saved}")
    if args.json:
        result.results.to_json(args.json)
    return 0
