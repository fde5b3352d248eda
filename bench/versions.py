"""Two versions of Purlin in one run: the standard collectives on virtual ranks of one GPU.

    git archive <rev> | tar -x -C /tmp/before     # the version to compare against
    PYTHONPATH=. python3 bench/versions.py --before /tmp/before [--ranks 4,8] [--out F.json]

The same measurement runs once per version in a fresh process whose ``PYTHONPATH`` is that
version's source tree, the versions alternating per rank count, so both see the same GPU,
clocks and loan. Per (ranks, collective, size): ``strategy="auto"`` and direct-push with the
fused-ll, fused and simple protocols, bfloat16, CUDA-graph replay per op (median of 10
replays of 20 ops), each bind checked once against the reference with the benchmarks' own
tolerance (``purlin.bench.providers.count_wrong``: bf16 rounding scaled by the rank count and
the inputs' magnitudes, so a ring's partial sums rounded at every hop are not counted wrong;
0 wrong or the row says how many). Only the bind API and that check are used, so any version
that has ``Cluster.virtual`` can be compared. Prints, per ranks and size, the geomean over the six
collectives of now / before for ``auto`` and for the best bind, with the worst collective;
writes every row as JSON, with what ran (strategy, protocol, kernel build, blocks, threads).
About 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (8 << 10, 64 << 10, 1 << 20, 16 << 20)
NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
# (the LL interpreter is left out: slower than fused-ll at every size, 40x at 1 MiB)
BINDS = (("auto", None), ("direct-push", "fused-ll"), ("direct-push", "fused"),
         ("direct-push", "simple"))


def _measure(label: str, ranks: int, sizes, out: str) -> None:
    """One version's rows (this process imports the version on PYTHONPATH)."""
    import numpy as np
    import torch

    from purlin import Cluster, collectives
    from purlin.bench.providers import count_wrong

    def time_bound(b, ops=20, repeats=10):
        g = b.capture(ops)
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1e3 / ops)
        b.check()
        return float(np.median(ts))

    rows = []
    cluster = Cluster.virtual(ranks)
    for name in NAMES:
        make = getattr(collectives, name)
        coll = make(ranks, 0) if name in ("broadcast", "reduce") else make(ranks)
        for nbytes in sizes:
            for strategy, protocol in BINDS:
                opts = {} if protocol is None else {"protocol": protocol}
                rec = {"version": label, "ranks": ranks, "collective": name, "bytes": nbytes,
                       "bind": strategy if protocol is None else f"{strategy} {protocol}"}
                try:
                    b = cluster.bind(coll, strategy, nbytes=nbytes, dtype="bfloat16", **opts)
                    rec["wrong"] = count_wrong(torch, b)
                    rec["us"] = time_bound(b)
                    rec["how"] = _how(b)
                except Exception as exc:  # a refusal is a result here
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(rec)
    Path(out).write_text(json.dumps(rows))


def _how(bound) -> str:
    """What ran: strategy, protocol, kernel build, blocks and threads, as far as this
    version's bind says (older versions name fewer of them)."""
    launches = getattr(bound, "launches", None) or [None]
    parts = (getattr(getattr(bound, "schedule", None), "strategy", None),
             getattr(bound, "protocol", None),
             getattr(getattr(launches[0], "launcher", None), "kernel", None),
             f"b{bound.blocks_per_lane}" if hasattr(bound, "blocks_per_lane") else None,
             f"t{bound.threads}" if hasattr(bound, "threads") else None)
    return " ".join(str(p) for p in parts if p is not None)


def _run_version(label: str, tree: Path, ranks: int, sizes) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", label, str(ranks),
           ",".join(map(str, sizes)), path]
    t0 = time.time()
    done = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {label} version ({tree}) failed on {ranks} ranks:\n"
                         f"{done.stderr[-3000:]}")
    rows = json.loads(Path(path).read_text())
    os.unlink(path)
    print(f"  {label}: {ranks} ranks, {len(rows)} binds in {time.time() - t0:.0f} s",
          flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (ranks, size): geomean and worst over the collectives of now / before, for
    ``auto`` and for the best bind (the fastest that ran and was right)."""
    def best(version, ranks, name, nbytes, bind=None):
        ok = [r["us"] for r in rows if r["version"] == version and r["ranks"] == ranks
              and r["collective"] == name and r["bytes"] == nbytes and "us" in r
              and r.get("wrong") == 0 and (bind is None or r["bind"] == bind)]
        return min(ok) if ok else None

    out = []
    for ranks in sorted({r["ranks"] for r in rows}):
        for nbytes in sorted({r["bytes"] for r in rows}):
            line = {"ranks": ranks, "bytes": nbytes}
            for what, bind in (("auto", "auto"), ("best", None)):
                ratios, worst = [], (0.0, None)
                refused = 0
                for name in NAMES:
                    a, b = best("now", ranks, name, nbytes, bind), best("before", ranks, name,
                                                                        nbytes, bind)
                    if a is None:
                        refused += 1
                    if a is None or b is None:
                        continue
                    ratios.append(a / b)
                    worst = max(worst, (a / b, name))
                line[what] = {
                    "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios))
                    if ratios else None, "worst": worst[0] or None, "worst_of": worst[1],
                    "compared": len(ratios), "now_missing": refused}
            out.append(line)
    return out


def _table(lines) -> str:
    head = ("ranks  size      auto now/before (geomean, worst)   best bind now/before "
            "(geomean, worst)")
    out = [head]

    def cell(d):
        if d["geomean"] is None:
            return "n/a (nothing to compare)".ljust(34)
        return (f"{d['geomean']:.3f}x, {d['worst']:.3f}x {d['worst_of']} "
                f"({d['compared']}/6)").ljust(34)

    for ln in lines:
        size = f"{ln['bytes'] >> 10} KiB" if ln["bytes"] < 1 << 20 else f"{ln['bytes'] >> 20} MiB"
        out.append(f"{ln['ranks']:>5}  {size:<8}  {cell(ln['auto'])} {cell(ln['best'])}")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        label, ranks, sizes, out = argv[1], int(argv[2]), argv[3], argv[4]
        _measure(label, ranks, [int(s) for s in sizes.split(",")], out)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="source tree of the version to compare")
    p.add_argument("--before-name", default=None,
                   help="what the JSON calls that version (a commit; default: the tree's "
                        "folder name, never its path)")
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    before = Path(args.before).resolve()
    if not (before / "purlin" / "__init__.py").is_file():
        p.error(f"--before {before} holds no purlin package (a source tree: git archive <rev>)")
    from purlin.bench.clusters import gpu_count
    from purlin.bench.scripts import gpu_env, output, run_info, write_json

    if not gpu_count():
        print("bench/versions.py needs a GPU (its ranks are virtual ranks on one)")
        return 2
    gpu_env()
    sizes = [int(s) for s in args.sizes.split(",")]
    t0 = time.time()
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for label, tree in (("before", before), ("now", ROOT)):
            rows += _run_version(label, tree, ranks, sizes)
    lines = summary(rows)
    print(_table(lines))
    wrong = [r for r in rows if r.get("wrong")]
    print(f"{len(rows)} binds, {len(wrong)} with wrong elements, "
          f"{sum('error' in r for r in rows)} refused")
    path = write_json(output(args.out, "versions.json"), {
        "info": run_info(seconds=time.time() - t0,
                         before=args.before_name or Path(before).name),
        "summary": lines, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
