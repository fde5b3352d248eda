"""Two versions of Purlin in one run: the standard collectives on virtual ranks of one GPU.

    git archive <rev> | tar -x -C /tmp/before     # the version to compare against
    PYTHONPATH=. python3 bench/versions.py --before /tmp/before [--ranks 4,8] [--out F.json]
        [--cases gqa,broadcast] [--rounds 2]

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

``--cases WORDS``: in place of the six collectives, the cases of
``bench/custom_vs_standard.py`` (this tree's definitions, in both versions) whose names hold
one of the comma-separated words, each custom collective and its twin, bound with ``auto``
and direct-push fused-ll / fused and direct-pull fused (where custom layouts run best).
``--rounds N``: the versions alternate N times per rank count (before, now, before, now...);
a bind's best time over the rounds counts.
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
CASE_BINDS = (("auto", None), ("direct-push", "fused-ll"), ("direct-push", "fused"),
              ("direct-pull", "fused"))


def _cases_module():
    """``bench/custom_vs_standard.py`` beside this script (its ``cases``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "custom_vs_standard", Path(__file__).resolve().parent / "custom_vs_standard.py")
    cvs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cvs)
    return cvs


def _targets(ranks: int, sizes, words):
    """(name, collective, size, bind options) of what one version measures: the six
    standard collectives, or with ``words`` the custom cases of ``custom_vs_standard.py``
    whose names hold one of them (custom and twin)."""
    from purlin import collectives

    if not words:
        for name in NAMES:
            make = getattr(collectives, name)
            coll = make(ranks, 0) if name in ("broadcast", "reduce") else make(ranks)
            for nbytes in sizes:
                yield name, coll, nbytes, {"nbytes": nbytes}, BINDS
        return
    cvs = _cases_module()
    for nbytes in sizes:
        for name, _, coll, csizes, twin, tsizes in cvs.cases(ranks, nbytes, 2):
            if any(w in name for w in words):
                yield f"{name} (custom)", coll, nbytes, {"chunk_sizes": csizes}, CASE_BINDS
                yield f"{name} (twin)", twin, nbytes, {"chunk_sizes": tsizes}, CASE_BINDS


def _measure(label: str, ranks: int, sizes, out: str, words=()) -> None:
    """One version's rows (this process imports the version on PYTHONPATH)."""
    import numpy as np
    import torch

    from purlin import Cluster
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
    for name, coll, nbytes, size, binds in _targets(ranks, sizes, words):
        for strategy, protocol in binds:
            opts = {} if protocol is None else {"protocol": protocol}
            rec = {"version": label, "ranks": ranks, "collective": name, "bytes": nbytes,
                   "bind": strategy if protocol is None else f"{strategy} {protocol}"}
            try:
                b = cluster.bind(coll, strategy, dtype="bfloat16", **size, **opts)
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


def _run_version(label: str, tree: Path, ranks: int, sizes, words=(),
                 round_: int = 0) -> list[dict]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", label, str(ranks),
           ",".join(map(str, sizes)), path, ",".join(words)]
    t0 = time.time()
    done = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {label} version ({tree}) failed on {ranks} ranks:\n"
                         f"{done.stderr[-3000:]}")
    rows = [{**r, "round": round_} for r in json.loads(Path(path).read_text())]
    os.unlink(path)
    print(f"  {label}: {ranks} ranks, {len(rows)} binds in {time.time() - t0:.0f} s",
          flush=True)
    return rows


def _best(rows: list[dict], version: str, ranks: int, name: str, nbytes: int,
          bind: str | None = None) -> float | None:
    """The fastest time of ``name`` (``bind``, else any) that ran and was right, in any
    round, or None."""
    ok = [r["us"] for r in rows if r["version"] == version and r["ranks"] == ranks
          and r["collective"] == name and r["bytes"] == nbytes and "us" in r
          and r.get("wrong") == 0 and (bind is None or r["bind"] == bind)]
    return min(ok) if ok else None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"


def summary(rows: list[dict]) -> list[dict]:
    """Per (ranks, size): geomean and worst over the collectives (or cases) of now / before,
    for ``auto`` and for the best bind (the fastest that ran and was right, in any round)."""
    names = list(dict.fromkeys(r["collective"] for r in rows))
    out = []
    for ranks in sorted({r["ranks"] for r in rows}):
        for nbytes in sorted({r["bytes"] for r in rows}):
            line = {"ranks": ranks, "bytes": nbytes}
            for what, bind in (("auto", "auto"), ("best", None)):
                ratios, worst = [], (0.0, None)
                refused = 0
                for name in names:
                    a = _best(rows, "now", ranks, name, nbytes, bind)
                    b = _best(rows, "before", ranks, name, nbytes, bind)
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
                f"({d['compared']})").ljust(34)

    for ln in lines:
        out.append(f"{ln['ranks']:>5}  {_size(ln['bytes']):<8}  {cell(ln['auto'])} {cell(ln['best'])}")
    return "\n".join(out)


def case_lines(rows: list[dict]) -> list[dict]:
    """Per (ranks, size, case) of a ``--cases`` run: each version's best custom and twin
    times (µs) and their ratio."""
    out = []
    cases = list(dict.fromkeys(r["collective"].rsplit(" (", 1)[0] for r in rows))
    for ranks in sorted({r["ranks"] for r in rows}):
        for nbytes in sorted({r["bytes"] for r in rows}):
            for case in cases:
                line = {"ranks": ranks, "bytes": nbytes, "case": case}
                for version in ("before", "now"):
                    c = _best(rows, version, ranks, f"{case} (custom)", nbytes)
                    t = _best(rows, version, ranks, f"{case} (twin)", nbytes)
                    line[version] = {"custom": c, "twin": t,
                                     "ratio": c / t if c and t else None}
                out.append(line)
    return out


def _case_table(lines) -> str:
    out = [f"{'case':<34} ranks size      custom before -> now (µs)   custom/twin before -> now"]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for ln in lines:
        b, n = ln["before"], ln["now"]
        out.append(f"{ln['case']:<34} {ln['ranks']:>5} {_size(ln['bytes']):<8} "
                   f"{num(b['custom'], '9.2f')} -> {num(n['custom'], '<9.2f')}        "
                   f"{num(b['ratio'], '.3f')} -> {num(n['ratio'], '.3f')}")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        label, ranks, sizes, out = argv[1], int(argv[2]), argv[3], argv[4]
        words = [w for w in (argv[5] if len(argv) > 5 else "").split(",") if w]
        _measure(label, ranks, [int(s) for s in sizes.split(",")], out, words)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="source tree of the version to compare")
    p.add_argument("--before-name", default=None,
                   help="what the JSON calls that version (a commit; default: the tree's "
                        "folder name, never its path)")
    p.add_argument("--ranks", default="4,8")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    p.add_argument("--out", default=None)
    p.add_argument("--cases", default=None,
                   help="custom_vs_standard.py's cases whose names hold one of these words "
                        "(say gqa,broadcast), custom and twin, in place of the six collectives")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate the versions this many times per rank count (default 1)")
    args = p.parse_args(argv)
    words = [w for w in (args.cases or "").split(",") if w]
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    if words and next(_targets(4, [8192], words), None) is None:
        p.error(f"--cases {args.cases}: no case of bench/custom_vs_standard.py holds "
                f"{' or '.join(words)} (python bench/custom_vs_standard.py --help names them)")
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
        for k in range(args.rounds):
            for label, tree in (("before", before), ("now", ROOT)):
                rows += _run_version(label, tree, ranks, sizes, words, k)
    lines = summary(rows)
    print(_table(lines))
    cases = case_lines(rows) if words else []
    if cases:
        print(_case_table(cases))
    wrong = [r for r in rows if r.get("wrong")]
    print(f"{len(rows)} binds, {len(wrong)} with wrong elements, "
          f"{sum('error' in r for r in rows)} refused")
    path = write_json(output(args.out, "versions.json"), {
        "info": run_info(seconds=time.time() - t0,
                         before=args.before_name or Path(before).name),
        "summary": lines, **({"cases": cases} if cases else {}), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
