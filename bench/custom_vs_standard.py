"""Custom collectives against their standard twins, moving the same bytes.

Each custom case (a rank-reversed all-gather, an all-gather of three unequal pieces per rank
delivered interleaved -- GQA's q, k, v --, a rotated reduce-scatter with max and with avg, an
uneven all-to-all, a multi-root broadcast, a partial all-reduce delivered to ranks that
contributed nothing, a layout that places one chunk twice in a rank's output, an all-reduce
one element past a 16-byte multiple, and GQA's pieces each one element longer: pieces off
16-byte boundaries inside the buffers) is timed beside the standard collective that moves the
same bytes (the odd sizes: the nearest whole size), with ``strategy="auto"`` and with the
best bind (direct-push with each protocol, direct-pull and auto's plan with each fused
protocol), on ``Cluster.virtual(n)`` (one GPU) or ``Cluster.local(n)`` where n GPUs are
visible. Every bind is checked once against the reference (0 wrong elements, else the row
says WRONG); binds that are refused are counted (a refused default or auto bind is a bug).
CUDA-graph replays, device time per op (``purlin.bench.providers``), the binds of one
collective timed in turns, three rounds.

    PYTHONPATH=. python3 bench/custom_vs_standard.py [--ranks 4,8] [--sizes 8KiB,64KiB,1MiB,16MiB]
        [--quick] [--out FILE.json] [--datapath sm|cpu] [--kind auto|virtual|local]
        [--cases gqa] [--rows] [--replay OLD.json]

``--replay OLD.json`` runs nothing: it prints what this tree's ``auto`` would pick at each
point of that run and how fast that bind was there (an ``auto`` rule checked before a GPU
measures it; a pick that run did not time is counted, not guessed).

``--cases gqa`` times only the cases whose name holds one of the comma-separated words (and
prints each one's fused op counts per rank: segmented, one op per row, and the twin's, for
direct-push and direct-pull on both fused protocols); ``--rows`` also times each custom case
with segmented ops off (``purlin.atom.fused_rows.segmented``: the rotated rows instead), its
ratio beside.

Budget: about 3-4 minutes on one H200 for the full run (--quick: 8 KiB and 64 KiB, auto and
the fused binds only). ``--datapath cpu`` runs the same cases on the cpu datapath (float16 for
bfloat16, wall time per call: not GPU numbers) -- what the tests run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from purlin.bench.scripts import run_info

KiB, MiB = 1 << 10, 1 << 20
SIZES = (8 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)
PROTOCOLS = ("simple", "ll", "fused", "fused-ll")
LL_MAX = 256 * KiB


# -- the cases ------------------------------------------------------------------------------
def _sizes(names, each: int) -> dict:
    return {k: each for k in names}


def _item(dtype: str) -> int:
    """The element bytes ``cases`` sizes pieces by (a run's and a replay's)."""
    return 2 if dtype in ("bfloat16", "float16") else 4


def _per_rank(nbytes: int, item: int, parts: int) -> int:
    """Elements of each of ``parts`` equal pieces of ``nbytes``, whole 16-byte items."""
    return max(16 // item, nbytes // item // parts // (16 // item) * (16 // item))


def cases(n: int, nbytes: int, item: int):
    """(name, twin name, custom collective, its chunk sizes, twin collective, its chunk
    sizes) at about ``nbytes`` per rank's largest buffer, both moving the same bytes."""
    from purlin.spec import Collective, collectives

    out = []
    g = _per_rank(nbytes, item, n)
    ag = collectives.all_gather(n)
    ag_sizes = _sizes(ag.input.names(), g)

    rev = Collective([[r] for r in range(n)], [list(range(n - 1, -1, -1))] * n, "copy",
                     name="reversed all-gather")
    out.append(("reversed all-gather", "all-gather", rev, _sizes(rev.input.names(), g), ag,
                ag_sizes))

    # q, k, v of 4:1:1 per rank, every rank receives q0..q{n-1}, k0.., v0..
    e = 16 // item
    unit = max(e, g // 6 // e * e)
    qkv = Collective([[(r, "q"), (r, "k"), (r, "v")] for r in range(n)],
                     [[(r, t) for t in ("q", "k", "v") for r in range(n)]] * n, "copy",
                     name="gqa all-gather")
    qkv_sizes = {(r, t): unit * (4 if t == "q" else 1) for r in range(n) for t in "qkv"}
    ag6 = _sizes(ag.input.names(), 6 * unit)
    out.append(("gqa all-gather", "all-gather", qkv, qkv_sizes, ag, ag6))
    # the same with one element more per piece: every piece after a rank's first off a
    # 16-byte boundary (odd-aligned copies), against the whole size's twin
    odd_qkv = {(r, t): k + 1 for (r, t), k in qkv_sizes.items()}
    out.append(("gqa all-gather, odd pieces", "all-gather", qkv, odd_qkv, ag, ag6))

    for op in ("max", "avg"):
        rs = collectives.reduce_scatter(n, op=op)
        rot = Collective([list(range(n))] * n, [[(r + 1) % n] for r in range(n)], op,
                         name=f"rotated reduce-scatter {op}")
        out.append((f"rotated reduce-scatter {op}", f"reduce-scatter {op}", rot,
                    _sizes(rot.input.names(), g), rs, _sizes(rs.input.names(), g)))

    a2a = collectives.all_to_all(n)
    base = _per_rank(nbytes, item, n)
    uneven = {(i, j): max(e, base * (1 + (i + 2 * j) % 3) // 2 // e * e)
              for i in range(n) for j in range(n)}
    total = sum(uneven.values())
    even = max(e, total // (n * n) // e * e)
    out.append(("uneven all-to-all", "all-to-all", a2a, uneven, a2a,
                _sizes(a2a.input.names(), even)))

    half = _per_rank(nbytes, item, 2)
    mr = Collective([["a"], ["b"]] + [[] for _ in range(n - 2)], [["a", "b"]] * n, "copy",
                    name="two-root broadcast")
    bc = collectives.broadcast(n)
    out.append(("two-root broadcast", "broadcast", mr, {"a": half, "b": half}, bc,
                {"x": 2 * half}))

    x = _per_rank(nbytes, item, 1)
    k = max(1, n // 2)
    partial = Collective([["x"] if r < k else [] for r in range(n)],
                         [[] if r < k else ["x"] for r in range(n)], "sum",
                         name="partial all-reduce to the others")
    red = collectives.reduce(n, root=0)
    out.append(("partial all-reduce to the others", "reduce", partial, {"x": x}, red,
                {"x": x}))

    twice = Collective([[r] for r in range(n)], [list(range(n)) + [r] for r in range(n)],
                       "copy", name="all-gather, own chunk twice")
    g1 = _per_rank(nbytes, item, n + 1)
    # the twin writes n chunks per rank where the custom layout writes n + 1: its chunks are
    # (n + 1) / n as long (whole 16-byte items), so both write the same bytes
    g_twin = max(e, (n + 1) * g1 // n // e * e)
    out.append(("all-gather, own chunk twice", "all-gather", twice,
                _sizes(twice.input.names(), g1), ag, _sizes(ag.input.names(), g_twin)))

    ar = collectives.all_reduce(n)
    names = ar.input.names()
    odd = _sizes(names, g)
    odd[names[-1]] += 1
    out.append(("all-reduce + 1 element", "all-reduce", ar, odd, ar, _sizes(names, g)))
    return out


# -- timing ---------------------------------------------------------------------------------
def _binds(quick: bool, nbytes: int) -> list[tuple[str, str, str | None]]:
    """(label, plan, protocol) of the binds tried: ``cluster.bind(..., "auto")`` as a user
    calls it, then direct-push with each protocol, and direct-pull (one lane and two: a
    layout's segments alternate lanes, a program each on the fused kernel) and auto's plan
    with each fused protocol (planned once each)."""
    out = [("auto", "auto", None)]
    for protocol in (("fused", "fused-ll") if quick else PROTOCOLS):
        if protocol.endswith("ll") and nbytes > LL_MAX:
            continue
        out.append((f"direct-push {protocol}", "direct-push", protocol))
        if not quick and protocol in ("fused", "fused-ll"):
            out.append((f"direct-pull {protocol}", "direct-pull", protocol))
            out.append((f"direct-pull 2 lanes {protocol}", "direct-pull 2 lanes", protocol))
            out.append((f"auto plan {protocol}", "auto plan", protocol))
    return out


def _schedule(cluster, coll, sizes, dtype, how, plans):
    """The plan a bind label asks for, made once per collective and sizes."""
    from purlin.runtime.auto import select
    from purlin.snac import plan

    key = (how, id(coll), tuple(sorted(sizes.items(), key=repr)))
    if key not in plans:
        if how == "auto plan":
            c = select(coll, cluster, chunk_sizes=sizes, dtype=dtype)
            if (c.chunks, c.lanes) == (1, 1) and c.strategy in ("direct-push", "direct-pull"):
                raise _NotHere("auto's plan is the direct-push or direct-pull bind's")
            plans[key] = plan(coll, c.strategy, chunk_sizes=sizes, dtype=dtype, chunks=c.chunks,
                              lanes=c.lanes, lanes_by=c.lanes_by)
        elif how.endswith(" 2 lanes"):
            plans[key] = plan(coll, how.removesuffix(" 2 lanes"), chunk_sizes=sizes,
                              dtype=dtype, lanes=2)
        else:
            plans[key] = plan(coll, how, chunk_sizes=sizes, dtype=dtype)
    return plans[key]


def _bind_sm(torch, cluster, coll, sizes, dtype, how, protocol, plans):
    """(the bind a label asks for, its wrong elements, how it runs)."""
    from purlin.atom import sm
    from purlin.bench.providers import count_wrong

    if how == "auto":
        bound = cluster.bind(coll, "auto", chunk_sizes=sizes, dtype=dtype)
    else:
        schedule = _schedule(cluster, coll, sizes, dtype, how, plans)
        bound = sm.bind(cluster, schedule, protocol=protocol, pdl=protocol != "simple")
    wrong = count_wrong(torch, bound)
    kernel = bound.launches[0].launcher.kernel
    lanes = f" {bound.schedule.lanes} lanes" if bound.schedule.lanes > 1 else ""
    how = (f"{bound.schedule.strategy}{lanes} {bound.protocol}{' pdl' if bound.pdl else ''} "
           f"{kernel} b{bound.blocks_per_lane} t{bound.threads}")
    return bound, wrong, how


ROUNDS = 3  # the binds of one collective are timed in turns, this many rounds


def _time_in_turns(torch, bound_by_label: dict, ops: int, repeats: int) -> dict:
    """{label: median per-op us} over ``ROUNDS`` rounds in which every bind is replayed in
    turn (``repeats`` replays in all, split over the rounds): a drift of the clocks during
    the point falls on every bind alike, not on whichever ran last -- ``auto`` and the bind
    it picked are the same kernel, and one timed after the other differed by up to 6%."""
    from purlin.bench.providers import graph_timer

    timers = {label: graph_timer(torch, b, ops) for label, b in bound_by_label.items()}
    per_op = {label: [] for label in timers}
    for _ in range(ROUNDS):
        for label, timed in timers.items():
            per_op[label] += timed(max(1, -(-repeats // ROUNDS)))
    for b in bound_by_label.values():
        b.check()
    return {label: float(sorted(t)[len(t) // 2]) for label, t in per_op.items()}


def _time_cpu(cluster, coll, sizes, dtype, strategy, protocol, ops, repeats):
    import numpy as np

    from purlin.spec.reference import reference

    if protocol not in (None, "simple"):
        raise _NotHere("the cpu datapath has no protocols")
    bound = cluster.bind(coll, strategy, chunk_sizes=sizes, dtype=dtype, timeout=30.0)
    sizing = bound.schedule.sizing
    rng = np.random.default_rng(0)
    xs = [rng.integers(-50, 50, sizing.input_count(r)).astype(bound.run.np_dtype)
          for r in range(coll.nranks)]
    outs = bound(xs)
    want = reference(sizing, [x.astype(np.float64) for x in xs])
    wrong = sum(int(np.sum(np.abs(np.asarray(o, np.float64) - w) > 2e-3 * (1 + np.abs(w))))
                for o, w in zip(outs, want))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(ops):
            bound(xs)
        times.append((time.perf_counter() - t0) * 1e6 / ops)
    return float(sorted(times)[len(times) // 2]), wrong, bound.schedule.strategy


class _NotHere(Exception):
    """A bind this datapath does not offer (not a refusal)."""


def measure(cluster, coll, sizes, dtype, binds, datapath, ops, repeats, refusals, torch=None):
    """{label: {us, wrong, how} or {refused: why}} over ``binds``; the best bind's label."""
    from purlin.errors import CapabilityError, PurlinError

    out, plans, bound = {}, {}, {}
    for label, strategy, protocol in binds:
        try:
            if datapath == "cpu":
                us, wrong, how = _time_cpu(cluster, coll, sizes, dtype, strategy, protocol,
                                           ops, repeats)
                out[label] = {"us": us, "wrong": wrong, "how": how}
            else:
                bound[label], wrong, how = _bind_sm(torch, cluster, coll, sizes, dtype,
                                                    strategy, protocol, plans)
                out[label] = {"wrong": wrong, "how": how}
        except _NotHere:
            continue
        except (CapabilityError, PurlinError) as exc:
            out[label] = {"refused": str(exc).splitlines()[0][:300]}
            refusals.append({"collective": coll.name, "bind": label, "default": label == "auto",
                             "why": out[label]["refused"]})
    if bound:
        for label, us in _time_in_turns(torch, bound, ops, repeats).items():
            out[label] = {"us": us, **out[label]}
        bound.clear()
        torch.cuda.empty_cache()
    timed = {k: v for k, v in out.items() if "us" in v and v["wrong"] == 0}
    best = min(timed, key=lambda k: timed[k]["us"]) if timed else None
    return out, best


def _cluster(datapath: str, kind: str, n: int):
    from purlin.runtime import Cluster

    if datapath == "cpu":
        return Cluster.cpu(n), "cpu"
    import torch

    count = torch.cuda.device_count()
    if kind == "local" or (kind == "auto" and count >= n):
        return Cluster.local(n), "local"
    return Cluster.virtual(n), "virtual"


def _fmt(entry) -> str:
    if entry is None:
        return "-"
    if "refused" in entry:
        return "REFUSED"
    if entry["wrong"]:
        return "WRONG"
    return f"{entry['us']:.2f}"


def _ratio(a, b):
    if not a or not b or "us" not in a or "us" not in b or a["wrong"] or b["wrong"]:
        return None
    return a["us"] / b["us"]


def op_counts(coll, sizes, dtype) -> dict:
    """{"strategy protocol": (ops of rank 0's fused program with segmented ops, without)}
    for direct-push and direct-pull on host buffers (no GPU), None where it does not fuse."""
    from purlin.atom.fused import fused_unit
    from purlin.atom.fused_rows import cluster_programs, several_pieces
    from purlin.atom.host import HostBuffers
    from purlin.snac import plan

    out = {}
    for strategy in ("direct-push", "direct-pull"):
        s = plan(coll, strategy, chunk_sizes=sizes, dtype=dtype)
        for protocol in ("fused", "fused-ll"):
            low = HostBuffers(s, ll=protocol == "fused-ll").lower()
            unit, problem = fused_unit(low, protocol)
            out[f"{strategy} {protocol}"] = None if problem else tuple(
                cluster_programs(low, lambda r: 0, 0, int, unit,
                                 segments=seg and several_pieces(s))[0].ops
                for seg in (True, False))
    return out


class _RowsOnly:
    """Within it, fused programs keep one op per row (no segmented ops): the programs as they
    were before segments, to time beside them in one run."""

    def __enter__(self):
        from purlin.atom import fused_rows

        self._was, fused_rows.segmented = fused_rows.segmented, lambda *a, **k: None
        return self

    def __exit__(self, *exc):
        from purlin.atom import fused_rows

        fused_rows.segmented = self._was


def _print_ops(name, n, nbytes, coll, csizes, tcoll, tsizes, dtype, log) -> dict:
    custom, twin = op_counts(coll, csizes, dtype), op_counts(tcoll, tsizes, dtype)
    if log is not None:
        for how in custom:
            c, t = custom[how], twin[how]
            print(f"  ops {name} n={n} {nbytes}B {how}: "
                  f"{'-' if c is None else f'segmented {c[0]}, a row each {c[1]}'}; twin "
                  f"{'-' if t is None else t[0]}", file=log)
    return {"custom": custom, "twin": twin}


def run(ranks, sizes, datapath="sm", kind="auto", quick=False, dtype="bfloat16", ops=None,
        repeats=None, log=sys.stdout, only=None, rows_too=False) -> dict:
    torch = None
    if datapath == "sm":
        import torch
    if datapath == "cpu" and dtype == "bfloat16":
        dtype = "float16"  # numpy has no bfloat16: the same bytes
    item = _item(dtype)
    ops = ops or (5 if datapath == "cpu" else 20 if quick else 40)
    repeats = repeats or (3 if datapath == "cpu" else 5 if quick else 10)
    rows, refusals, cache = [], [], {}
    t0 = time.monotonic()
    for n in ranks:
        cluster, where = _cluster(datapath, kind, n)
        for nbytes in sizes:
            binds = _binds(quick or datapath == "cpu", nbytes)
            if datapath == "cpu":
                binds = [("auto", "auto", None), ("direct-push", "direct-push", None)]
            for name, twin, coll, csizes, tcoll, tsizes in cases(n, nbytes, item):
                if only and not any(word in name for word in only):
                    continue
                counts = _print_ops(name, n, nbytes, coll, csizes, tcoll, tsizes, dtype,
                                    log) if only else None
                custom, cbest = measure(cluster, coll, csizes, dtype, binds, datapath, ops,
                                        repeats, refusals, torch)
                unseg, ubest = {}, None
                if rows_too:
                    with _RowsOnly():
                        unseg, ubest = measure(cluster, coll, csizes, dtype, binds, datapath,
                                               ops, repeats, refusals, torch)
                key = (n, tcoll, tuple(sorted(tsizes.items(), key=repr)))
                if key not in cache:
                    cache[key] = measure(cluster, tcoll, tsizes, dtype, binds, datapath, ops,
                                         repeats, refusals, torch)
                standard, sbest = cache[key]
                moved = [sum(csizes.values()) * item, sum(tsizes.values()) * item]
                row = {"case": name, "twin": twin, "nranks": n, "cluster": where,
                       "nbytes": nbytes, "dtype": dtype, "input_bytes": moved,
                       "custom": custom, "standard": standard,
                       "custom_best": cbest, "standard_best": sbest,
                       "ratio_auto": _ratio(custom.get("auto"), standard.get("auto")),
                       "ratio_best": _ratio(custom.get(cbest), standard.get(sbest)),
                       "auto_vs_best": _ratio(custom.get("auto"), custom.get(cbest)),
                       "standard_auto_vs_best": _ratio(standard.get("auto"),
                                                       standard.get(sbest))}
                wrong = any("us" in v and v["wrong"] for v in (*custom.values(),
                                                               *standard.values()))
                if counts is not None:
                    row["op_counts"] = counts
                if rows_too:
                    row["rows_only"], row["rows_only_best"] = unseg, ubest
                    row["ratio_rows_only"] = _ratio(unseg.get(ubest), standard.get(sbest))
                    wrong = wrong or any("us" in v and v["wrong"] for v in unseg.values())
                row["status"] = "WRONG" if wrong else "ok"
                rows.append(row)
                _print_row(row, log)
                if rows_too and log is not None:
                    r = row["ratio_rows_only"]
                    print(f"  {'(a row each, no segments)':<32} best "
                          f"{_fmt(unseg.get(ubest)):>8} ratio {'-' if r is None else f'{r:.2f}'}"
                          f"  {ubest or '-'}", file=log)
    out = {"rows": rows, "refusals": refusals,
           "default_refusals": sum(1 for r in refusals if r["default"]),
           "info": run_info(datapath, time.monotonic() - t0, ranks=list(ranks), sizes=list(sizes),
                            dtype=dtype, quick=quick)}
    _print_summary(out, log)
    return out


HEADER = (f"{'case':<34} {'n':>2} {'size':>7} {'auto':>8} {'best':>8} {'std auto':>8} "
          f"{'std best':>8} {'ratio':>6}  best bind")


def _print_row(row, log) -> None:
    if log is None:
        return
    if not getattr(log, "_header", False):
        print(HEADER, file=log)
        try:
            log._header = True
        except AttributeError:
            pass
    c, s = row["custom"], row["standard"]
    ratio = row["ratio_best"]
    size = (f"{row['nbytes'] // MiB}M" if row["nbytes"] >= MiB else
            f"{row['nbytes'] // KiB}K" if row["nbytes"] >= KiB else f"{row['nbytes']}")
    print(f"{row['case']:<34} {row['nranks']:>2} {size:>7} {_fmt(c.get('auto')):>8} "
          f"{_fmt(c.get(row['custom_best'])):>8} {_fmt(s.get('auto')):>8} "
          f"{_fmt(s.get(row['standard_best'])):>8} "
          f"{'-' if ratio is None else f'{ratio:.2f}':>6}  {row['custom_best'] or '-'}"
          f"{'  WRONG' if row['status'] != 'ok' else ''}", file=log)


def _print_summary(out, log) -> None:
    if log is None:
        return
    rows = out["rows"]
    ratios = [r["ratio_best"] for r in rows if r["ratio_best"]]
    gm = (lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan"))
    print(f"\n{len(rows)} rows, {sum(r['status'] != 'ok' for r in rows)} WRONG; "
          f"custom/standard (best) geomean {gm(ratios):.3f}, worst "
          f"{max(ratios, default=float('nan')):.3f}", file=log)
    for side, key in (("custom", "auto_vs_best"), ("standard", "standard_auto_vs_best")):
        autos = [r[key] for r in rows if r.get(key)]  # (a twin measured once per size)
        print(f"auto/best bind, {side}: geomean {gm(autos):.3f}, worst "
              f"{max(autos, default=float('nan')):.3f}, past 1.05x: "
              f"{sum(a > 1.05 for a in autos)}", file=log)
    print(f"refusals: {len(out['refusals'])} ({out['default_refusals']} from auto binds)",
          file=log)
    for r in out["refusals"]:
        print(f"  {r['collective']} [{r['bind']}]: {r['why']}", file=log)


def replay(path: str, log=sys.stdout, ranks=None) -> dict:
    """``auto``'s choices of this tree for the points of an earlier run's JSON (those of
    ``ranks`` ranks where given), each looked up among the binds that run timed (no GPU
    needed): what this tree's ``auto`` would take there, before a GPU measures it. A choice
    that run did not time as a bind is "not timed", or "refused there" where the run's tree
    refused that bind (a fast path it lacked)."""
    import types

    from purlin.runtime.auto import select

    with open(path) as f:
        data = json.load(f)
    gpus = data.get("info", {}).get("gpus") or [None]
    found, missing, refused = [], 0, 0
    for r in data["rows"]:
        if ranks is not None and r["nranks"] not in ranks:
            continue
        cluster = types.SimpleNamespace(datapath="sm", kind=r.get("cluster", "virtual"),
                                        nranks=r["nranks"], devices=[0] * r["nranks"])
        case = next(c for c in cases(r["nranks"], r["nbytes"], _item(r["dtype"]))
                    if c[0] == r["case"])
        for side, coll, sizes in (("custom", case[2], case[3]), ("standard", case[4], case[5])):
            timed = {k: v for k, v in r[side].items() if "us" in v}  # (not the refused)
            c = select(coll, cluster, chunk_sizes=sizes, dtype=r["dtype"], gpu=gpus[0])
            label = f"{c.strategy} {c.protocol}"
            if (c.chunks, c.lanes) != (1, 1) or label not in timed:
                label = f"auto plan {c.protocol}"
                if not timed.get(label, {}).get("how", "").startswith(c.strategy):
                    label = None
            best = min(v["us"] for v in timed.values())
            if "refused" in r[side].get(f"{c.strategy} {c.protocol}", {}):
                refused += 1
                print(f"{r['case']:<34} {r['nranks']} {r['nbytes']:>9} {side:<8} "
                      f"{c.strategy} {c.protocol}: refused there", file=log)
                continue
            if label is None:
                missing += 1
                print(f"{r['case']:<34} {r['nranks']} {r['nbytes']:>9} {side:<8} "
                      f"{c.strategy} {c.protocol}: not timed", file=log)
                continue
            ratio = timed[label]["us"] / best
            found.append(ratio)
            if ratio > 1.05:
                print(f"{r['case']:<34} {r['nranks']} {r['nbytes']:>9} {side:<8} {label} "
                      f"{timed[label]['us']:.2f} us, best {best:.2f}: {ratio:.2f}x", file=log)
    out = {"timed": len(found), "not_timed": missing, "refused_there": refused,
           "worst": max(found, default=None), "over_1_05": sum(x > 1.05 for x in found)}
    print(f"replayed {path}: {out['timed']} choices timed there, {refused} refused there, "
          f"{missing} not timed; worst "
          f"{out['worst']:.3f}x the best bind, {out['over_1_05']} past 1.05x", file=log)
    return out


def main(argv=None) -> int:
    from purlin.cli import size_list

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8", help="rank counts (default 4,8)")
    ap.add_argument("--sizes", default=None, help="8KiB,64KiB,1MiB,16MiB (default)")
    ap.add_argument("--quick", action="store_true", help="8 KiB and 64 KiB, fewer binds")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--datapath", default="sm", choices=("sm", "cpu"))
    ap.add_argument("--kind", default="auto", choices=("auto", "virtual", "local"),
                    help="GPU clusters: local where n GPUs are visible (auto), else virtual")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", default=None,
                    help="only the cases whose name holds one of these words (say gqa), with "
                         "their fused op counts")
    ap.add_argument("--rows", action="store_true",
                    help="also time the custom cases with segmented ops off")
    ap.add_argument("--replay", metavar="JSON",
                    help="no run: this tree's auto choices for that earlier run's points, "
                         "looked up among the binds it timed")
    args = ap.parse_args(argv)
    if args.replay:
        replay(args.replay)
        return 0
    ranks = [int(x) for x in args.ranks.split(",")]
    sizes = size_list(args.sizes) or (list(SIZES[:2]) if args.quick else list(SIZES))
    only = [w.strip() for w in args.cases.split(",")] if args.cases else None
    out = run(ranks, sizes, args.datapath, args.kind, args.quick, args.dtype, only=only,
              rows_too=args.rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 1 if any(r["status"] != "ok" for r in out["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
